"""The incremental detokenizer gives the text a full decode gives, token by token, for both tokenizer styles."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from arctic_rl_core.engines.sampling.native.detokenizer import INCOMPLETE, IncrementalDetokenizer, decode

TEXT = "Le café du coin — naïve 日本語 🙂 costs 3.50€; the answer is <answer>42</answer>.\n  Done,  twice!"


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: '▁' marks spaces and a decode drops the text's leading space."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator([TEXT] * 50, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level BPE", "metaspace"])
def style(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer(style, tiny_model):
    """Byte-level BPE (Qwen's, Llama 3's) splits characters across tokens; metaspace drops a leading space."""
    return AutoTokenizer.from_pretrained(tiny_model) if style == "byte-level BPE" else metaspace_tokenizer()


def test_each_style_has_the_trap_it_is_here_for(style, tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    splits = any(decode(tokenizer, ids[:i]).endswith(INCOMPLETE) for i in range(len(ids)))
    whole = [i for i in range(1, len(ids)) if INCOMPLETE not in decode(tokenizer, ids[:i]) + decode(tokenizer, ids[i:])]
    drops_space = any(decode(tokenizer, ids[i:]) != TEXT[len(decode(tokenizer, ids[:i])) :] for i in whole)
    assert (splits, drops_space) == ((True, False) if style == "byte-level BPE" else (False, True))


def test_the_text_grows_as_a_full_decode_except_for_an_unfinished_character(tokenizer):
    prompt = tokenizer("Question: ", add_special_tokens=False)["input_ids"]
    completion = tokenizer(TEXT, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    detokenizer = IncrementalDetokenizer(len(prompt))
    token_ids = list(prompt)
    for token in completion:
        token_ids.append(token)
        before = detokenizer.text
        new = detokenizer.extend(tokenizer, token_ids)
        assert detokenizer.text == before + new
        full = decode(tokenizer, token_ids[len(prompt) :])
        if full.endswith(INCOMPLETE):  # held back until the token that completes the character
            assert full.startswith(detokenizer.text) and len(detokenizer.text) < len(full)
        else:
            assert detokenizer.text == full
    assert detokenizer.text == TEXT


def test_several_tokens_at_once_give_the_same_text(tokenizer):
    completion = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(0)
    assert detokenizer.extend(tokenizer, completion[:5]) == decode(tokenizer, completion[:5])
    assert detokenizer.extend(tokenizer, completion[:5]) == ""  # nothing new
    detokenizer.extend(tokenizer, completion)
    assert detokenizer.text == TEXT
