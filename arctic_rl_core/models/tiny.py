"""Tiny real Hugging Face causal LMs with a locally trained tokenizer.

Tests, demos and CPU smoke recipes need a model without touching a hub. This
module builds one of a real architecture (Qwen2, Qwen3, Llama, Mistral), with
random weights fixed by a seed and a byte-level BPE tokenizer trained here on a
generated corpus, and saves both with ``save_pretrained`` so that every engine
loads it by path exactly as it would load ``Qwen/Qwen3-4B``.

    python -m arctic_rl_core.models.tiny /tmp/tiny-qwen2 --family qwen2
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

FAMILIES = ("qwen2", "qwen3", "llama", "mistral")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as the Qwen families use it: verl, TRL and SkyRL apply chat templates.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was he she they we you i be at by this "
    "have from or one had not but what all were when there can which their if do will each "
    "about how up out them then many some so these would other into has more her two like him "
    "see time could no make than first been its who now people my made over did down only way "
    "find use may water long little very after words called just where most know get through "
    "back much before go good new write our used me man too any day same right look think also "
    "around another came come work three word must because does part even place well such here "
    "take why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last "
    "never us left end along while might next sound below saw something thought both few those "
    "always looked show large often together asked house world going want school important until "
    "question answer number total sum price apples each how many more less left buy sell cost "
    "dollars hours minutes days week year half twice times plus minus equals result step first "
    "select from where group order by count avg max min join on limit table name id value "
    "document passage title paragraph according context who which when where what why"
).split()


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny model. Head dim 64: vLLM's CPU attention rejects 16."""

    family: str = "qwen2"
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    seed: int = 0


def _corpus(seed: int, lines: int = 4000) -> list[str]:
    """A deterministic corpus covering words, numbers, arithmetic, SQL and chat markup."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        kind = i % 4
        if kind == 0:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))) + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            out.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}. #### {a}")
        elif kind == 2:
            out.append(
                f"SELECT name, COUNT(*) FROM t{rng.randint(0, 9)} WHERE id > {rng.randint(0, 99)} GROUP BY name;"
            )
        else:
            out.append(
                f"<|im_start|>user\n{rng.choice(_WORDS)} {rng.choice(_WORDS)}?<|im_end|>\n<|im_start|>assistant\n"
            )
    return out


def train_tokenizer(vocab_size: int = 1024, seed: int = 0):
    """Train a byte-level BPE tokenizer (digits split one per token) on the generated corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single-digit tokens keep arithmetic learnable for tiny models, as in Llama/Qwen.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(spec: TinySpec, vocab_size: int, eos_token_id: int, pad_token_id: int):
    """The HF config of ``spec.family`` at tiny scale."""
    from transformers import AutoConfig

    if spec.family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {spec.family!r}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
    )
    if spec.family == "qwen2":
        # Qwen2's config has no head_dim: it is always hidden_size / num_heads.
        if spec.hidden_size != spec.head_dim * spec.num_heads:
            raise ValueError(f"qwen2 needs hidden_size == head_dim * num_heads, got {spec}")
        common.pop("head_dim")
    return AutoConfig.for_model(spec.family, **common)


def build_tiny_model(path: str | Path, spec: TinySpec | None = None, **overrides) -> Path:
    """Build, seed and save a tiny model plus its tokenizer under ``path``; return the path.

    The same spec always gives the same weights and tokenizer, so a test can
    rebuild it anywhere. An existing directory built from the same spec is
    reused as is.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = spec or TinySpec(**overrides)
    path = Path(path)
    marker = path / "tiny_spec.json"
    if marker.exists() and json.loads(marker.read_text()) == asdict(spec):
        return path
    tokenizer = train_tokenizer(spec.vocab_size, seed=spec.seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = make_config(spec, len(tokenizer), eos, pad)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(asdict(spec)))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--family", default="qwen2", choices=FAMILIES)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = build_tiny_model(
        args.path, TinySpec(family=args.family, num_layers=args.layers, hidden_size=args.hidden_size, seed=args.seed)
    )
    print(out)


if __name__ == "__main__":
    main()
