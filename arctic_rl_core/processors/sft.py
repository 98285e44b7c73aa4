"""``sft``: masked cross-entropy (negative log-likelihood) of the loss tokens.

The mask chooses what is learned (``response_mask`` for the completion only,
or the attention mask for every token). ``token-mean`` (the default) is the
usual mean NLL per loss token over the whole call; the other modes weight
sequences as their names say (see aggregation.py).

Metrics: ``nll`` (token-weighted mean negative log-likelihood; its exp is the
perplexity) and ``entropy`` when computed.
"""

from __future__ import annotations

from arctic_rl_core.processors.aggregation import AggregatedLossConfig, aggregate, token_mean_metric
from arctic_rl_core.processors.base import LossInputs, LossOutput
from arctic_rl_core.processors.registry import register_loss


class SFTConfig(AggregatedLossConfig):
    pass


@register_loss("sft", config_model=SFTConfig)
def sft_loss(inputs: LossInputs, config: SFTConfig) -> LossOutput:
    nll = -inputs.logprobs.float()
    metrics = {"nll": token_mean_metric(nll, inputs.mask)}
    if inputs.entropy is not None:
        metrics["entropy"] = token_mean_metric(inputs.entropy, inputs.mask)
    return LossOutput(loss=aggregate(nll, inputs, config.loss_agg_mode, config.num_sequences), metrics=metrics)
