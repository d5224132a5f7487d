"""flux_trainer.sdscripts.rng_state without sd-scripts: the generators put back, and a watched sampler replaying the
rest of a saved epoch and the epochs after it."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import RandomSampler

from flux_trainer.sdscripts import rng_state


def test_a_block_draws_nothing_the_run_keeps():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    with rng_state.untouched():
        torch.rand(3), random.random(), np.random.rand()
    after = (torch.rand(3).tolist(), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == after


def test_the_watched_sampler_hands_out_what_the_sampler_draws():
    torch.manual_seed(4)
    plain = [list(RandomSampler(range(7))) for _ in range(3)]
    torch.manual_seed(4)
    watched = rng_state.EpochOrder(RandomSampler(range(7)), lambda: 0)
    assert [list(watched) for _ in range(3)] == plain and len(watched) == 7


def test_a_sampler_with_its_own_generator_resumes_its_later_epochs():
    """With several processes accelerate gives the sampler a generator of its own: the epochs after the resumed one
    draw their order from it as the run did."""

    def sampler(seed):
        return RandomSampler(range(5), generator=torch.Generator().manual_seed(seed))

    whole = rng_state.EpochOrder(sampler(3), lambda: 0)
    want = [list(whole) for _ in range(3)]
    trained = [0]
    run = rng_state.EpochOrder(sampler(3), lambda: trained[0])
    list(run)
    trained[0] = 5
    batches = iter(run)
    first = [next(batches) for _ in range(3)]  # the loader fetches one ahead of the step
    trained[0] = 7
    saved = run.saved(at_step_start=False)
    assert (saved["trained"], saved["taken"], saved["at"], sorted(saved["fetch"])) == (2, 3, "fetch", [3])
    resumed = rng_state.EpochOrder(sampler(99), lambda: 7)
    resumed.replay = saved
    assert first[:2] + list(resumed) == want[1]
    assert list(resumed) == want[2]
