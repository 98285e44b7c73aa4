"""GSM8K with SkyRL: data in SkyRL's format, and launch scripts with arctic-rl as the backend."""
