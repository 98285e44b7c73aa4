"""ArcticGRPOTrainer: TRL's GRPOTrainer with generation, log-probs, loss and optimizer on arctic-rl engines.

    trainer = ArcticGRPOTrainer(
        model="Qwen/Qwen3-0.6B", reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
        arctic_config=ArcticRLClientConfig(model_name="Qwen/Qwen3-0.6B", training_gpus=1, sampling_gpus=1),
    )
    trainer.train()

TRL keeps its loop: datasets and samplers, reward functions and weights,
advantages, generation buffering, logging, callbacks, checkpoint state. The
overridden hooks are the narrow places where TRL would run the model:

=====================================  ==============================================================
GRPOTrainer hook                       here
=====================================  ==============================================================
``_generate_single_turn``              ``client.generate`` with token ids (sampler log-probs kept)
``_get_per_token_logps_and_entropies`` ``client.fwd_no_grad``: training job (old), log-prob job (ref)
``_generate_and_score_completions``    TRL's, then the arctic sampler's importance-sampling weights
``training_step``                      TRL's ``_prepare_inputs``, then one ``client.fwd_bwd`` (grpo)
``compute_loss`` (evaluation)          ``client.fwd_no_grad`` and the same grpo loss, in process
``create_optimizer``                   ``ArcticOptimizer``: ``client.step()`` then ``sync_weights()``
``save_model``                         ``client.save_checkpoint`` next to TRL's checkpoint files
=====================================  ==============================================================

The model TRL holds has no weights (see ``model_shell``); no reference copy is
loaded either: the reference log-probs come from the arctic log-prob job.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from transformers.trainer import TRAINING_ARGS_NAME
from trl import GRPOConfig, GRPOTrainer

from arctic_rl_core import ArcticRLClient, ArcticRLClientConfig, create_arctic_rl_client
from arctic_rl_trl.batch import Rows, shifted_to_completion
from arctic_rl_trl.compat import Problem, grpo_config_problems, raise_problems
from arctic_rl_trl.engine_config import training_config_problems, with_grpo_training_config, with_processed_logprobs
from arctic_rl_trl.event_loop import EventLoopThread
from arctic_rl_trl.importance_sampling import ImportanceSamplingCorrection
from arctic_rl_trl.loss import LossBatch, LossMapping, completion_loss_mask, loss_batch
from arctic_rl_trl.model_shell import weightless_model
from arctic_rl_trl.optimizer import ArcticOptimizer
from arctic_rl_trl.sampling import ArcticSampler, SamplerSettings

ARCTIC_CHECKPOINT = "arctic_checkpoint"

# fwd_bwd metrics TRL logs under its own names; the others are logged as "arctic/<name>".
TRL_METRIC_NAMES = {"entropy": "entropy", "kl": "kl", "clip_frac": "clip_ratio/region_mean"}


class ReferenceOnLogProbJob:
    """Stands in for TRL's ``ref_model``: reference log-probs are computed by the arctic log-prob job."""

    def __repr__(self) -> str:
        return "<reference policy on the arctic log-prob job>"


class ArcticGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer``'s arguments, plus ``arctic_config`` (starts a deployment) or ``arctic_client`` (uses one).

    With ``arctic_config``, GRPOConfig's optimizer, schedule, clipping, precision
    and gradient checkpointing are written into its ``training_config`` and the
    trainer owns the deployment (``shutdown()`` stops it). With ``arctic_client``,
    the jobs keep the training config they were created with (build it with
    ``training_config_from_grpo``) and the caller owns them.
    """

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        *,
        arctic_config: ArcticRLClientConfig | None = None,
        arctic_client: ArcticRLClient | None = None,
    ):
        if (arctic_config is None) == (arctic_client is None):
            raise TypeError(
                "ArcticGRPOTrainer needs exactly one of arctic_config= (an ArcticRLClientConfig: the trainer starts "
                "the deployment) or arctic_client= (a client of a running deployment)"
            )
        deployment = arctic_config if arctic_config is not None else arctic_client.config
        if args is None:
            args = GRPOConfig(f"{Path(deployment.model_name).name}-GRPO")
        problems = grpo_config_problems(args)
        problems += _argument_problems(model, deployment, optimizers, peft_config, quantization_config)
        problems += _job_problems(arctic_config, arctic_client, args, rollout_func)
        if arctic_config is not None:
            problems += training_config_problems(arctic_config.training_config, args)
        raise_problems(problems)

        if isinstance(model, str):
            init = args.model_init_kwargs or {}
            model = weightless_model(
                model,
                trust_remote_code=init.get("trust_remote_code", args.trust_remote_code),
                **({"revision": init["revision"]} if "revision" in init else {}),
            )
        raise_problems(_dropout_problems(model, args))
        # beta=0 during GRPOTrainer.__init__ keeps it from loading a second copy of the policy as the reference.
        beta = args.beta
        args.beta = 0.0
        try:
            super().__init__(
                model=model,
                reward_funcs=reward_funcs,
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                reward_processing_classes=reward_processing_classes,
                callbacks=callbacks,
                optimizers=optimizers,
                tools=tools,
                rollout_func=rollout_func,
                environment_factory=environment_factory,
            )
        finally:
            args.beta = beta
        self.beta = beta
        self.ref_model = ReferenceOnLogProbJob() if beta != 0.0 else None
        raise_problems(self._runtime_problems())

        self._loop = EventLoopThread()
        self._owns_client = arctic_client is None
        if arctic_client is None:
            deployment = with_processed_logprobs(
                with_grpo_training_config(
                    arctic_config, self.args, self._planned_max_steps(), self._no_decay_parameters()
                )
            )
            arctic_client = create_arctic_rl_client(deployment)
        self.arctic_client = arctic_client
        self._sampler_logprobs_processed = (deployment.vllm_config or {}).get("logprobs_mode") == "processed_logprobs"
        self._syncs_sampler = _has_job(arctic_client, "sampling")
        self._loss = LossMapping.from_args(self.args)
        self._importance_sampling = ImportanceSamplingCorrection.from_args(self.args)
        settings = SamplerSettings.from_args(self.args, self.eos_token_ids)
        self._sampler = ArcticSampler(arctic_client, self._loop, settings)
        self._arctic_optimizer: ArcticOptimizer | None = None

    # ------------------------------------------------------------ construction

    def _runtime_problems(self) -> list[Problem]:
        """What only GRPOTrainer's own setup reveals: the processing class, MoE aux loss, process count."""
        rules = [
            ("processing_class", type(self.processing_class).__name__, self._is_vlm,
             "the arctic engines take text tokens only; pass a tokenizer"),
            ("router_aux_loss_coef", self.router_aux_loss_coef, self.aux_loss_enabled,
             "the arctic grpo loss adds no MoE load-balancing loss; set router_aux_loss_coef=0.0"),
            ("num_processes", self.accelerator.num_processes, self.accelerator.num_processes > 1,
             "run ArcticGRPOTrainer in one process; the arctic engines spread the work over their GPUs"),
        ]  # fmt: skip
        return [Problem(option, value, fix) for option, value, refused, fix in rules if refused]

    def _no_decay_parameters(self) -> list[str]:
        """The parameters HF's Trainer leaves undecayed (by name and norm-layer type): the engine's AdamW skips them."""
        decay = set(self.get_decay_parameter_names(self.model))
        return sorted(
            name for name, param in self.model.named_parameters() if param.requires_grad and name not in decay
        )

    def _planned_max_steps(self) -> int:
        """The optimizer steps ``train()`` will run, computed as the Trainer does, for the engine's LR schedule."""
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _arctic(self, coroutine):
        return self._loop.run(coroutine)

    def shutdown(self) -> None:
        """Stop the deployment this trainer started (a client passed in stays the caller's) and its event loop."""
        if self._loop.closed:
            return
        if self._owns_client:
            self._arctic(self.arctic_client.shutdown())
        self._loop.close()

    # ------------------------------------------------------------ generation and log-probs

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("images: the arctic sampling engine takes text token ids only")
        return self._sampler.complete(prompt_ids, num_generations)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal_inputs,
    ):
        """Completion log-probs: the training engine's for the policy, the log-prob job's for the reference."""
        rows = Rows.from_sequences(input_ids, attention_mask, logits_to_keep)
        result = self._fwd_no_grad(rows, model is self.ref_model, self._loss.post(), compute_entropy)
        logps = shifted_to_completion(result["log_probs_shifted"], logits_to_keep).to(input_ids.device)
        entropies = None
        if compute_entropy:
            entropies = shifted_to_completion(result["entropy_shifted"], logits_to_keep).to(input_ids.device)
        return logps, entropies, None

    def _fwd_no_grad(self, rows: Rows, reference: bool, post: list, entropy: bool = False) -> dict:
        return self._arctic(
            self.arctic_client.fwd_no_grad(
                batch=rows.model_batch(), reference_model=reference, processing={"post": post}, return_entropy=entropy
            )
        )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        sampler_logps = output.get("sampling_per_token_logps")
        # TRL corrects only vLLM's log-probs (use_vllm, which this trainer refuses): a rollout_func's are kept
        # in the output but weigh nothing, so only the arctic sampler's own log-probs are corrected.
        if self._importance_sampling is not None and sampler_logps is not None and self.rollout_func is None:
            self._weigh_by_sampler_mismatch(output, sampler_logps)
        return output

    def _weigh_by_sampler_mismatch(self, output: dict, sampler_logps: torch.Tensor) -> None:
        """TRL's vLLM importance-sampling correction, against the arctic sampler's log-probs."""
        rows = Rows.from_completions(
            output["prompt_ids"], output["prompt_mask"], output["completion_ids"], output["completion_mask"]
        )
        if "old_per_token_logps" not in output:
            output["old_per_token_logps"] = self._completion_logps(rows, self._loss.post())
        # Processed sampler log-probs score the sampling distribution: the trainer's side is TRL's, at the
        # sampling temperature. Raw ones score the logits, so the trainer's side is taken at temperature 1 too.
        at_temperature_one = not self._sampler_logprobs_processed and self._loss.post()
        trainer_logps = self._completion_logps(rows, []) if at_temperature_one else output["old_per_token_logps"]
        mask = completion_loss_mask(output)
        ratio = self._importance_sampling.ratio(trainer_logps, sampler_logps, mask)
        output["importance_sampling_ratio"] = ratio
        mode = "train" if self.model.training else "eval"
        for name, value in self._importance_sampling.metrics(ratio, trainer_logps, sampler_logps, mask).items():
            self._metrics[mode][name].append(value)

    def _completion_logps(self, rows: Rows, post: list) -> torch.Tensor:
        result = self._fwd_no_grad(rows, reference=False, post=post)
        return shifted_to_completion(result["log_probs_shifted"], rows.completion_length).to(self.accelerator.device)

    # ------------------------------------------------------------ loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        """GRPOTrainer.training_step with forward and backward on the arctic training engine.

        Trainer.training_step would backpropagate through the local model; that
        model has no weights here, so this keeps GRPOTrainer's bookkeeping
        (``_step``, ``step_time``) around TRL's ``_prepare_inputs`` (generation,
        rewards, advantages, buffering) and one ``fwd_bwd``.
        """
        started = time.perf_counter()
        model.train()
        inputs = self._prepare_inputs(inputs)
        loss = self._fwd_bwd(inputs)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - started
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _fwd_bwd(self, inputs) -> torch.Tensor:
        # A micro-batch with no completion token to train on (e.g. all truncated and masked) still goes to the
        # engine: its loss and gradients are 0, as TRL's backward of a zero loss, and the step still runs.
        batch = self._loss_batch(inputs, self.current_gradient_accumulation_steps)
        result = self._arctic(
            self.arctic_client.fwd_bwd(batch=batch.rows.model_batch(batch.context), processing=batch.processing)
        )
        self._record_loss_metrics("train", result["metrics"])
        return torch.tensor(result["loss"], device=self.args.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The GRPO loss without gradients (TRL's evaluation): engine log-probs, and the grpo loss in process."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        mode = "train" if self.model.training else "eval"
        batch = self._loss_batch(inputs, self.current_gradient_accumulation_steps if mode == "train" else 1)
        outputs = self._fwd_no_grad(batch.rows, reference=False, post=batch.processing["post"], entropy=True)
        result = batch.evaluate(outputs["log_probs_shifted"], outputs["entropy_shifted"])
        metrics = {name: float(total / weight) if weight else 0.0 for name, (total, weight) in result.metrics.items()}
        self._record_loss_metrics(mode, {**metrics, **{name: float(v) for name, v in result.maxima.items()}})
        return result.loss.to(self.args.device)

    def _loss_batch(self, inputs, accumulation_steps: int) -> LossBatch:
        # TRL's dapo divides by the completion tokens of one accumulation window (with a single process).
        step_tokens = float(inputs["num_items_in_batch"])
        if self.model.training:
            step_tokens *= accumulation_steps / self.args.steps_per_generation
        return loss_batch(inputs, self._loss, accumulation_steps, step_tokens)

    def _record_loss_metrics(self, mode: str, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            if name == "kl" and self.beta == 0.0:
                continue
            self._metrics[mode][TRL_METRIC_NAMES.get(name, f"arctic/{name}")].append(value)

    # ------------------------------------------------------------ optimizer

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            params = (self.model if model is None else model).parameters()
            self._arctic_optimizer = ArcticOptimizer(params, self.args.learning_rate, self._step_engine)
            self.optimizer = self._arctic_optimizer
        return self.optimizer

    def _step_engine(self) -> dict:
        # Every optimizer step reaches the engine, even one whose micro-batches held no loss token (zero
        # gradients): HF's AdamW and LR schedule step then too, and the engine must keep pace with them.
        result = self._arctic(self.arctic_client.step())
        if self._syncs_sampler:
            self._arctic(self.arctic_client.sync_weights())
        return result

    def _clip_grad_norm(self, model):
        return None  # the engine clips at max_grad_norm inside client.step()

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known after client.step(); logged by _maybe_log_save_evaluate

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ):
        # learning_rate stays the Trainer's scheduler over the same GRPOConfig schedule: the engine reports the
        # rate of its next step, not of the one just taken.
        last = self._arctic_optimizer.last_step if self._arctic_optimizer is not None else None
        if last is not None:
            grad_norm = last["grad_norm"]
        super()._maybe_log_save_evaluate(
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )

    # ------------------------------------------------------------ checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The engine's resumable checkpoint under ``<output_dir>/arctic_checkpoint``, plus config and tokenizer."""
        directory = Path(output_dir or self.args.output_dir).resolve()
        self._arctic(self.arctic_client.save_checkpoint(path=str(directory / ARCTIC_CHECKPOINT)))
        if self.args.should_save:
            self.model.config.save_pretrained(directory)
            self.model.generation_config.save_pretrained(directory)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(directory)
            torch.save(self.args, directory / TRAINING_ARGS_NAME)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """TRL restores its own state; the engine must have been started from the checkpoint's arctic files."""
        expected = (Path(resume_from_checkpoint) / ARCTIC_CHECKPOINT).resolve()
        started_from = self.arctic_client.config.checkpoint_path
        if started_from is None or Path(started_from).resolve() != expected:
            raise ValueError(
                f"resume_from_checkpoint={str(resume_from_checkpoint)!r}: the arctic training engine loads its "
                f"weights and optimizer when it starts; create it with ArcticRLClientConfig("
                f"checkpoint_path={str(expected)!r}), got checkpoint_path={started_from!r}"
            )


def _same_model(a: str, b: str) -> bool:
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def _argument_problems(model, deployment: ArcticRLClientConfig, optimizers, peft_config, quantization_config):
    """GRPOTrainer arguments that have no meaning when the arctic engines hold and train the weights."""
    name = model if isinstance(model, str) else getattr(model, "name_or_path", "")
    peft = peft_config is not None or (not isinstance(model, str) and is_peft_model(model))
    rules = [
        ("model", name, not _same_model(name, deployment.model_name),
         f"the arctic engines load {deployment.model_name!r}; pass the same model to both"),
        ("peft_config", type(peft_config or model).__name__, peft,
         "PEFT is not supported: the arctic training engine trains every weight; pass peft_config=None and a "
         "plain model"),
        ("quantization_config", type(quantization_config).__name__, quantization_config is not None,
         "the arctic engines load the model themselves; pass quantization_config=None"),
        ("optimizers", tuple(type(p).__name__ for p in optimizers), any(p is not None for p in optimizers),
         "the arctic training engine owns the optimizer and its schedule (set them in GRPOConfig); pass "
         "optimizers=(None, None)"),
    ]  # fmt: skip
    return [Problem(option, value, fix) for option, value, refused, fix in rules if refused]


def _dropout_problems(model, args: GRPOConfig) -> list[Problem]:
    """``disable_dropout`` zeroes the driver's copy only; the engine trains the model as its config says."""
    rates = sorted({m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0})
    if not (args.disable_dropout and rates):
        return []
    fix = (
        f"the arctic training engine trains with the model's dropout (rates {rates}); set disable_dropout=False, "
        "or use a model whose config sets its dropout rates to 0"
    )
    return [Problem("disable_dropout", True, fix)]


def _has_job(client: ArcticRLClient, kind: str) -> bool:
    try:
        getattr(client, f"{kind}_job_id")
    except ValueError:
        return False
    return True


def _job_problems(arctic_config, arctic_client, args: GRPOConfig, rollout_func) -> list[Problem]:
    """The jobs this run needs: training always, sampling unless a rollout_func samples, log-prob when beta != 0."""
    if arctic_client is not None:
        present = {kind: _has_job(arctic_client, kind) for kind in ("training", "sampling", "log_prob")}
        where = "arctic_client"
    else:
        present = {
            kind: getattr(arctic_config, f"{kind}_gpus") > 0 or getattr(arctic_config, f"{kind}_job_id") is not None
            for kind in ("training", "sampling", "log_prob")
        }
        where = "arctic_config"
    needs = [("training", True, "the policy trains there")]
    needs.append(("sampling", rollout_func is None, "completions are sampled there (or pass rollout_func)"))
    needs.append(("log_prob", args.beta != 0.0, f"beta={args.beta} needs reference log-probs from it"))
    return [
        Problem(f"{where}.{kind}_gpus", 0, f"a {kind} job is needed: {why}; set {kind}_gpus >= 1")
        for kind, needed, why in needs
        if needed and not present[kind]
    ]
