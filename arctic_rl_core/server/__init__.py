"""The arctic-rl server: a JobManager behind HTTP (FastAPI + uvicorn) or a Ray actor."""
