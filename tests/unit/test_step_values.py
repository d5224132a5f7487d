"""train.sync_free: the loss read from a copy queued at the forward, sd-scripts' norm means logged once on the host."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flux_trainer.sdscripts.hooks import RunHooks
from flux_trainer.sdscripts.runner import RunnerSpec
from flux_trainer.sdscripts.step_values import NORM_TAGS, DeferredNorms, EarlyLoss, HostCopy, early_loss


def a_loss(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    return w, (w.sin() * w).mean()


def test_the_loop_reads_the_queued_copy_not_the_device():
    _, loss = a_loss()
    early = early_loss(loss)
    assert isinstance(early, EarlyLoss) and early._early[0].host.item() == loss.item()
    early._early[0].host.fill_(123.0)  # only the copy changes: the reads below must come from it
    assert early.detach().item() == 123.0 and early.item() == 123.0
    assert loss.item() != 123.0


def test_a_loss_changed_in_place_after_the_copy_is_read_from_the_device():
    _, loss = a_loss(1)
    early = early_loss(loss)
    early._early[0].host.fill_(123.0)
    with torch.no_grad():
        loss.add_(1.0)  # the copy is stale now
    assert early.detach().item() == loss.item() != 123.0


def test_the_early_loss_trains_like_the_plain_one():
    w1, loss1 = a_loss(2)
    w2, loss2 = a_loss(2)
    early = early_loss(loss2)
    scaled = early / 4  # what accelerate does with gradient accumulation: a plain tensor from here on
    assert type(scaled) is torch.Tensor
    loss1.div(4).backward()
    scaled.backward()
    torch.testing.assert_close(w2.grad, w1.grad, rtol=0, atol=0)
    assert early.detach().item() == loss1.item()


def test_a_cpu_copy_keeps_the_value_it_was_made_with():
    t = torch.tensor([1.5, 2.5])
    copy = HostCopy(t)
    t.mul_(10)
    assert copy.ready() and copy.value().tolist() == [1.5, 2.5]


class FakeLoRANetwork:
    """The three methods sd-scripts' LoRANetwork has and its loop calls every step; each call returns new norms."""

    def __init__(self):
        self.calls = 0

    def _norms(self, offset: float) -> torch.Tensor:
        self.calls += 1
        return torch.rand(7, generator=torch.Generator().manual_seed(self.calls)) + offset

    def weight_norms(self):
        return self._norms(1.0)

    def grad_norms(self):
        return self._norms(2.0)

    def combined_weight_norms(self):
        return None  # no GGPO: sd-scripts' method returns None, and so do we, queueing nothing


def loop_step(network) -> dict[str, float | None]:
    """What sd-scripts' loop does with the three methods (train_network.py, after the optimizer step)."""
    w, g, c = network.weight_norms(), network.grad_norms(), network.combined_weight_norms()
    return {
        "weight": w.mean().item() if w is not None else None,
        "grad": g.mean().item() if g is not None else None,
        "combined": c.mean().item() if c is not None else None,
    }


def test_deferred_norms_give_the_loop_none_and_log_the_same_means_at_their_steps():
    plain, net = FakeLoRANetwork(), FakeLoRANetwork()
    want = [loop_step(plain) for _ in range(3)]
    norms = DeferredNorms()
    assert norms.install(net) == list(NORM_TAGS)
    written = []
    for step in (1, 2, 3):
        assert loop_step(net) == {"weight": None, "grad": None, "combined": None}
        norms.label(step)
        norms.flush(lambda values, step: written.append((step, values)))
    assert written == [
        (s, {tag: pytest.approx(want[s - 1][key], rel=1e-6)})
        for s in (1, 2, 3)
        for key, tag in (("weight", NORM_TAGS["weight_norms"]), ("grad", NORM_TAGS["grad_norms"]))
    ]
    assert DeferredNorms.uninstall(net) and loop_step(net)["grad"] is not None
    assert not DeferredNorms.uninstall(net)


def test_values_wait_for_their_copies_in_order_unless_told_to_wait(monkeypatch):
    landed = {"yes": False}
    monkeypatch.setattr(HostCopy, "ready", lambda self: landed["yes"])
    net, norms = FakeLoRANetwork(), DeferredNorms()
    norms.install(net)
    written = []
    net.grad_norms()
    assert norms.flush(lambda v, step: written.append(step)) == 0  # not labelled yet: no step to write it under
    norms.label(4)
    net.grad_norms()  # the next step's, made before step 4's copy landed
    assert norms.flush(lambda v, step: written.append(step)) == 0 and written == []
    norms.label(5)
    assert norms.flush(lambda v, step: written.append(step), wait=True) == 2 and written == [4, 5]
    assert norms.pending == []


def test_nothing_is_kept_where_nothing_would_be_logged():
    net, norms = FakeLoRANetwork(), DeferredNorms(keep=False)
    norms.install(net)
    assert loop_step(net)["grad"] is None and net.calls == 2  # still computed (sd-scripts' side effects), not kept
    assert norms.pending == []


class LoggingAccelerator:
    device = SimpleNamespace(type="cpu")
    is_main_process = True

    def __init__(self):
        self.logged = []

    def log(self, values, step=None):
        self.logged.append((step, values))

    def get_tracker(self, *_a, **_k):
        raise ValueError("no tracker in this test")


def run_hooks(tmp_path, **spec) -> RunHooks:
    h = RunHooks(RunnerSpec(sd_scripts="", train_toml="", dataset_toml="", **spec), tmp_path)
    h.metrics = SimpleNamespace(on_step_end=lambda step: {}, mark_data_ready=lambda: None)
    h.loss_guard = SimpleNamespace(check=lambda loss, step: None)
    h.slowdown = SimpleNamespace(observe=lambda s, step: None)
    h._texts_written = True
    return h


def test_hooks_log_each_steps_norms_under_its_step_and_wait_at_the_last(tmp_path, monkeypatch):
    landed = {"yes": False}
    monkeypatch.setattr(HostCopy, "ready", lambda self: landed["yes"])
    h, acc, net = run_hooks(tmp_path), LoggingAccelerator(), FakeLoRANetwork()
    h._max_steps = 2
    h.step_start(acc, net)
    loop_step(net)
    h.step_end(acc, {}, 1)
    assert acc.logged == []  # step 1's copy has not landed: the loop went on without it
    h.step_start(acc, net)
    loop_step(net)
    h.step_end(acc, {}, 2)
    assert acc.logged == []  # the last step's loss/current is logged before anything waits
    h.step_logged(acc, 2)  # the last step logged: everything is written before sd-scripts closes TensorBoard
    assert [(s, sorted(v)) for s, v in acc.logged] == [
        (1, ["norm/avg_key_norm"]),
        (1, ["norm/avg_grad_norm"]),
        (2, ["norm/avg_key_norm"]),
        (2, ["norm/avg_grad_norm"]),
    ]


def test_sync_free_off_leaves_the_loss_and_the_network_as_they_are(tmp_path):
    h, net = run_hooks(tmp_path, sync_free=False), FakeLoRANetwork()
    _, loss = a_loss()
    assert h.loss_made(loss) is loss
    h.step_start(LoggingAccelerator(), net)
    assert h.norms is None and loop_step(net)["grad"] is not None
    h = run_hooks(tmp_path)
    assert isinstance(h.loss_made(loss), EarlyLoss)
    h.step_start(LoggingAccelerator(), net)
    assert loop_step(net)["grad"] is None


def test_only_the_main_process_with_tensorboard_keeps_values(tmp_path):
    acc = LoggingAccelerator()
    acc.is_main_process = False
    h, net = run_hooks(tmp_path), FakeLoRANetwork()
    h.step_start(acc, net)
    loop_step(net)
    assert h.norms.pending == []
    h, net = run_hooks(tmp_path), FakeLoRANetwork()
    h.metrics = None  # logging.tensorboard=false
    h.step_start(LoggingAccelerator(), net)
    loop_step(net)
    assert h.norms.pending == []


def test_sd_scripts_loop_calls_these_methods_and_logs_their_means_under_these_tags():
    from flux_trainer.config import ConfigError
    from flux_trainer.sdscripts.checkout import locate

    try:
        checkout = locate()
    except ConfigError as exc:
        pytest.skip(f"needs an sd-scripts checkout: {exc}")
    source = (checkout.path / "train_network.py").read_text()
    for name, tag in NORM_TAGS.items():
        assert f"network.{name}()" in source and f'logs["{tag}"]' in source, (name, tag)
    assert "current_loss = loss.detach().item()" in source
