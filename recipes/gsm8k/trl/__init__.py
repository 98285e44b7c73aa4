"""GSM8K with TRL: the stock GRPOTrainer script, and the same script on arctic-rl with ArcticGRPOTrainer."""
