# Sourced by recipes/<task>/skyrl/run_cpu_smoke.sh: the SkyRL settings every CPU smoke run shares.
#
#   skyrl_cpu_smoke PYTHON OUT STEPS <the task's SkyRL overrides ...>
#
# Runs stock `main_base` on a CPU-sized run: float32, no gradient checkpointing, no evaluation, no
# checkpoints (unless the task's overrides ask), TensorBoard logs in OUT/tensorboard, and SkyRL's
# checkpoints, exports (exports/arctic_rl_status.json) and logs under OUT. The task's overrides come last
# and win: its data, environment, batch sizes, entrypoint and trainer.arctic_rl block.
skyrl_cpu_smoke() {
    local python=$1 out=$2 steps=$3
    shift 3
    TENSORBOARD_DIR="$out/tensorboard" "$python" -m skyrl.train.entrypoints.main_base \
        data.dataloader.num_workers=0 \
        trainer.policy.model.path="$out/model" \
        trainer.max_training_steps="$steps" \
        trainer.eval_interval=-1 \
        trainer.eval_before_train=false \
        trainer.ckpt_interval=-1 \
        trainer.bf16=false \
        trainer.gradient_checkpointing=false \
        trainer.logger=tensorboard \
        trainer.enable_ray_gpu_monitor=false \
        trainer.ckpt_path="$out/ckpts" \
        trainer.export_path="$out/exports" \
        trainer.log_path="$out/logs" \
        "$@"
}
