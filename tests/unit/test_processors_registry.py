"""The loss registry: names, aliases, config parsing, and the guarded import of dotted paths."""

import sys
import textwrap

import pytest

from arctic_rl_core.processors import (
    ClippedPolicyConfig,
    LossConfig,
    LossConfigError,
    PPOConfig,
    UnknownLossError,
    register_loss,
    registered_losses,
    resolve_loss,
)

# A stdlib module nothing in this code base imports: if a refused path imported it, sys.modules would show it.
CANARY = "tabnanny"


def test_builtin_losses_are_registered():
    assert {"grpo", "ppo", "sft", "importance_sampling"} <= set(registered_losses())


@pytest.mark.parametrize("alias", ["arctic_platform.rl.processors.grpo_loss", "arctic_rl_core.processors.grpo_loss"])
def test_grpo_aliases_resolve_without_any_import(alias):
    before = set(sys.modules)
    assert resolve_loss(alias) is resolve_loss("grpo")
    assert "arctic_platform" not in sys.modules
    assert set(sys.modules) == before


def test_ppo_parses_its_own_defaults():
    grpo, ppo = resolve_loss("grpo"), resolve_loss("ppo")
    assert isinstance(ppo.parse_config({}), PPOConfig)
    assert ppo.parse_config({}).clip_ratio_c == 3.0
    assert grpo.parse_config(None).clip_ratio_c is None
    assert grpo.parse_config({}) == ClippedPolicyConfig()


def test_unknown_name_error_lists_registered_losses_and_allowed_prefixes():
    with pytest.raises(UnknownLossError) as err:
        resolve_loss("dpo", allowed_prefixes=["my_org.losses"])
    message = str(err.value)
    assert "'dpo'" in message
    for name in ("grpo", "ppo", "sft", "importance_sampling", "'my_org.losses'"):
        assert name in message


def test_unknown_loss_error_is_a_value_error():
    assert issubclass(UnknownLossError, ValueError)


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "subprocess.call",
        "builtins.eval",
        f"{CANARY}.check",
        f".{CANARY}.check",
        f"..{CANARY}",
        f"{CANARY}..check",
        f"{CANARY}.check()",
        f"__import__('{CANARY}').check",
        f"{CANARY}.check ",
        f"{CANARY}/check",
        f"{CANARY}",
        "",
        ".",
    ],
)
def test_paths_outside_the_allowed_prefixes_are_refused_without_importing(name):
    assert CANARY not in sys.modules, "the canary module must not be imported before this test"
    before = set(sys.modules)
    with pytest.raises(UnknownLossError, match="allowed prefixes: 'my_plugins'"):
        resolve_loss(name, allowed_prefixes=("my_plugins",))
    assert set(sys.modules) == before


def test_a_prefix_allows_whole_path_components_only():
    with pytest.raises(UnknownLossError, match="outside the allowed prefixes"):
        resolve_loss(f"{CANARY}.check", allowed_prefixes=(CANARY[:3],))
    assert CANARY not in sys.modules


def test_a_request_cannot_use_a_dotted_path_when_no_prefix_is_allowed():
    with pytest.raises(UnknownLossError, match=r"none \(dotted paths are disabled\)"):
        resolve_loss("arctic_rl_core.processors.policy_loss.ppo_loss")


def test_allowed_dotted_path_to_a_registered_loss_resolves_to_it():
    path = "arctic_rl_core.processors.policy_loss.ppo_loss"
    spec = resolve_loss(path, allowed_prefixes=["arctic_rl_core.processors"])
    assert spec is resolve_loss("ppo")


@pytest.fixture(scope="module")
def plugin_module(tmp_path_factory):
    """A loss plugin on sys.path, importable only through an allowed prefix."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "arctic_test_loss_plugin.py").write_text(
        textwrap.dedent(
            """
            from arctic_rl_core.processors import LossConfig, LossOutput, register_loss

            class SquaredConfig(LossConfig):
                scale: float = 1.0

            @register_loss("test_plugin_squared_logprob", config_model=SquaredConfig)
            def squared_logprob(inputs, config):
                return LossOutput(loss=config.scale * (inputs.logprobs ** 2).sum())

            def not_a_loss(inputs, config):
                return None
            """
        )
    )
    sys.path.insert(0, str(root))
    yield "arctic_test_loss_plugin"
    sys.path.remove(str(root))


def test_allowed_plugin_module_is_imported_and_its_loss_resolves(plugin_module):
    spec = resolve_loss(f"{plugin_module}.squared_logprob", allowed_prefixes=[plugin_module])
    assert spec.name == "test_plugin_squared_logprob"
    assert spec.parse_config({"scale": 2}).scale == 2.0


def test_allowed_path_to_a_function_that_is_not_a_registered_loss_is_refused(plugin_module):
    with pytest.raises(UnknownLossError, match="'not_a_loss' in module 'arctic_test_loss_plugin' is not a loss"):
        resolve_loss(f"{plugin_module}.not_a_loss", allowed_prefixes=[plugin_module])


def test_allowed_path_to_a_missing_module_names_the_import_error():
    with pytest.raises(UnknownLossError, match="module 'my_plugins.nowhere' cannot be imported"):
        resolve_loss("my_plugins.nowhere.loss", allowed_prefixes=["my_plugins"])


def test_a_malformed_allowed_prefix_is_an_operator_error():
    with pytest.raises(ValueError, match="allowed loss prefix 'my plugins'"):
        resolve_loss("grpo", allowed_prefixes=["my plugins"])


def test_registering_a_taken_name_fails():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_loss("grpo", config_model=LossConfig)(lambda inputs, config: None)


@pytest.mark.parametrize(
    "config, message",
    [
        ({"eps_clip": -0.1}, r"eps_clip: Input should be greater than 0 \(got -0.1\)"),
        ({"eps": 0.2}, r"eps: Extra inputs are not permitted"),
        ({"kl_estimator": "k4"}, r"kl_estimator: Input should be 'k1', 'k2', 'k3'"),
        ({"loss_agg_mode": "mean"}, r"loss_agg_mode: Input should be 'token-mean'"),
        ({"clip_ratio_c": 0.5}, r"clip_ratio_c: Input should be greater than 1"),
        ({"kl_coef": float("inf")}, r"kl_coef: Input should be a finite number"),
        ([("eps_clip", 0.1)], r"must be a mapping"),
    ],
)
def test_bad_loss_config_errors_name_the_field_and_value(config, message):
    with pytest.raises(LossConfigError, match=message) as err:
        resolve_loss("grpo").parse_config(config)
    assert "loss 'grpo'" in str(err.value)


def test_required_context_and_entropy_follow_the_config():
    grpo = resolve_loss("grpo")
    plain = grpo.parse_config({})
    assert grpo.required_context(plain) == {"advantages"}
    assert not grpo.needs_entropy(plain)
    with_kl_and_entropy = grpo.parse_config({"kl_coef": 0.01, "entropy_coef": 0.001})
    assert grpo.required_context(with_kl_and_entropy) == {"advantages", "ref_log_probs_shifted"}
    assert grpo.needs_entropy(with_kl_and_entropy)
    importance_sampling = resolve_loss("importance_sampling")
    assert importance_sampling.required_context(importance_sampling.parse_config({})) == {
        "advantages",
        "old_log_probs_shifted",
    }
    sft = resolve_loss("sft")
    assert sft.required_context(sft.parse_config({})) == frozenset()
