"""The README's main job learns: GRPO through the arctic-rl client raises held-out reward."""

import pytest

from arctic_rl_core.demo import DemoConfig, run_demo

pytestmark = pytest.mark.slow


def test_grpo_demo_raises_held_out_reward_far_beyond_chance(tmp_path):
    # Seed 0, 20 GRPO steps. Held-out reward is the mean of 800 samples (200 prompts x 4); its
    # standard error is below 0.018, so a rise of 0.25 is over ten standard errors: not chance.
    config = DemoConfig(steps=20, eval_every=10, seed=0, out_dir=str(tmp_path), progress=False)
    result = run_demo(config)
    assert [step for step, _ in result.evals] == [0, 10, 20]
    assert result.last_eval - result.first_eval >= 0.25, result.evals
    assert len(result.train_rewards) == 20 and all(0.0 <= r <= 1.0 for r in result.train_rewards)
