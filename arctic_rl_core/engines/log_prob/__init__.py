"""Log-prob / reference engines (log_prob_engine="vllm" or "deepspeed")."""
