"""`flux-train bench --tiers`: every memory tier at its size less a display's 0.5 GiB with plain sd-scripts beside it,
and the tier table (targets, the card's peak against the tier, a larger tier never slower) from its results."""

from __future__ import annotations

import json
import os

import pytest

from flux_trainer.commands import bench
from flux_trainer.commands.bench import BenchResult, tier_rows, tier_table
from flux_trainer.sdscripts.runner import VRAM_CAP_ENV


def ours(tier: str, s: float, peak: float, kernels: str = "auto") -> BenchResult:
    return BenchResult(case=f"{tier}_k-{kernels}_1024", overrides=[f"memory={tier}", f"kernels={kernels}"],
                       exit_code=0, s_per_step=s, card_peak_gib=peak)  # fmt: skip


def plain(of: BenchResult, s: float, peak: float) -> BenchResult:
    return BenchResult(case=f"{of.case} (plain sd-scripts)", overrides=[], exit_code=0, s_per_step=s,
                       card_peak_gib=peak)  # fmt: skip


def test_rows_pair_each_tier_with_its_plain_run_and_check_targets_and_peaks():
    v8, v24, v32 = ours("vram8", 0.75, 7.2), ours("vram24", 0.41, 23.6), ours("vram32", 0.45, 29.0)
    rows = tier_rows([v8, plain(v8, 1.5, 7.0), v24, plain(v24, 1.0, 17.0), v32, plain(v32, 1.0, 28.0)])
    assert [r["tier"] for r in rows] == ["vram8", "vram24", "vram32"]  # smallest first
    by = {r["tier"]: r for r in rows}
    assert by["vram8"]["ratio"] == pytest.approx(2.0) and by["vram8"]["met"]  # 0.75 <= 0.80, 2.0x >= 1.8x, 7.2 <= 7.5
    assert by["vram24"]["limit_gib"] == 23.5 and not by["vram24"]["met"]  # 23.6 GiB on the card: over the limit
    assert not by["vram32"]["met"] and by["vram32"]["slower_than"] == "vram24"  # 0.45 > 0.38, and slower than 24
    assert "rtx4060" in by["vram8"]["cards"] and "rtx5090" in by["vram32"]["cards"]
    text = tier_table(rows)
    assert text.count("\n") == 4 and "| vram8 |" in text and "2.00x" in text and "NO" in text


def test_a_slow_ratio_misses_the_target_even_under_the_time():
    v8 = ours("vram8", 0.70, 7.0)
    (row,) = tier_rows([v8, plain(v8, 1.1, 7.0)])
    assert row["s_per_step"] <= row["target_s_per_step"] and not row["met"]  # 1.57x < 1.8x


def test_the_reported_run_is_the_last_kernel_set_the_one_plain_ran_beside():
    off, auto = ours("vram16", 1.0, 14.0, "off"), ours("vram16", 0.48, 14.5)
    auto.loss_rel_diff, auto.lora_cosine, auto.compared_to = 0.012, 0.999, off.case
    (row,) = tier_rows([off, auto, plain(auto, 1.1, 14.6)])
    assert row["kernels"] == "auto" and row["s_per_step"] == 0.48 and row["met"]
    assert "1.20% / 0.9990" in tier_table([row])


def test_tiers_runs_every_tier_capped_with_plain_beside_and_writes_the_table(tmp_path, monkeypatch, capsys):
    ran, caps = [], []

    def run_case(name, overrides, res, ns, root):
        ran.append(name)
        caps.append(float(os.environ[VRAM_CAP_ENV]))
        return ours(overrides[0].removeprefix("memory="), 0.3, 1.0)

    monkeypatch.setattr(bench, "run_case", lambda *a: _with_dir(run_case(*a), tmp_path))
    monkeypatch.setattr(bench, "run_baseline", lambda r, ns: plain(r, 0.9, 1.0))
    out = tmp_path / "b.json"
    assert bench.bench_main(["--tiers", "vram8", "vram24", "--json", str(out), "--root", str(tmp_path)]) == 0
    assert ran == ["vram8_k-auto_1024", "vram24_k-auto_1024"] and caps == [7.5, 23.5]  # kernels=auto by default
    saved = json.loads(out.read_text())
    assert [t["tier"] for t in saved["tiers"]] == ["vram8", "vram24"] and saved["vram_cap_gib"] == "tier"
    assert len(saved["results"]) == 4  # each tier and plain sd-scripts beside it
    assert "| vram24 |" in capsys.readouterr().out
    assert bench.bench_main(["--table", str(out)]) == 0  # the table again, from the file
    assert "| vram8 |" in capsys.readouterr().out


def _with_dir(result: BenchResult, folder) -> BenchResult:
    result.run_dir = str(folder)
    return result


def test_an_unknown_tier_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        bench.bench_main(["--tiers", "vram9"])
    assert refused.value.code == 2 and "vram9" in capsys.readouterr().err


def test_a_table_of_several_benches_keeps_each_tiers_last_finished_run_and_names_its_own_settings():
    failed = BenchResult(case="vram8_k-auto_1024", overrides=["memory=vram8", "kernels=auto"], exit_code=1)
    done = ours("vram8", 0.58, 7.4)
    tuned = BenchResult(case="vram32_true_k-auto_1024", exit_code=0, s_per_step=0.37, card_peak_gib=20.4,
                        overrides=["model=random", "train.output_name=vram32_true_k-auto_1024", "memory=vram32",
                                   "memory.fp8_base=true", "kernels=auto"])  # fmt: skip
    rows = {r["tier"]: r for r in tier_rows([done, plain(done, 1.4, 10.0), failed, tuned])}
    assert rows["vram8"]["s_per_step"] == 0.58 and rows["vram8"]["plain_s_per_step"] == 1.4  # not the failed one
    assert rows["vram32"]["settings"] == ["memory.fp8_base=true"]
    text = tier_table(list(rows.values()))
    assert "| vram32 (memory.fp8_base=true) |" in text and "| - |" in text  # no plain run: no ratio


@pytest.mark.parametrize("tier, fp8", [("vram24", True), ("vram80", False)])
def test_numerics_take_the_fp8_tolerance_from_the_tier_s_own_toml(compose, tmp_path, tier, fp8):
    """A tier whose TOML has an fp8 base (in its [precision] table, as written) is judged at 4%, the others at 2%."""
    from flux_trainer.sdscripts.translate import RunPaths, training_document

    doc = training_document(compose("+dataset=mychar", f"memory={tier}"), RunPaths(tmp_path))
    (tmp_path / "sd_scripts.toml").write_text(doc.dumps())
    r = BenchResult(case=f"{tier}_k-auto_1024", overrides=[f"memory={tier}"], exit_code=0, run_dir=str(tmp_path),
                    loss_rel_diff=0.03, lora_cosine=0.999)  # fmt: skip
    assert bench.numerics_met(r) is fp8  # 3% apart: within fp8's 4%, over bf16's 2%


def test_the_table_of_json_files_judges_fp8_as_the_bench_did(tmp_path):
    """`--table` reads results away from their run dirs: the fp8 base read at the bench travels in the JSON."""
    r = BenchResult(case="vram16_k-auto_1024", overrides=["memory=vram16"], exit_code=0, run_dir="/gone",
                    loss_rel_diff=0.03, lora_cosine=0.999, fp8_base=True)  # fmt: skip
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"results": [bench.asdict(r)]}))
    assert bench.numerics_met(bench.results_from([path])[0]) is True
    assert bench.numerics_met(BenchResult(**{**bench.asdict(r), "fp8_base": None})) is False  # no TOML at /gone


def test_a_larger_tier_within_noise_of_a_smaller_one_is_not_slower():
    """vram48 runs vram32's settings: 0.363 against 0.361 on two cards is the same speed; 3% slower is slower."""
    v32, v48 = ours("vram32", 0.361, 20.4), ours("vram48", 0.363, 20.4)
    by = {r["tier"]: r for r in tier_rows([v32, v48])}
    assert by["vram48"]["met"] and "slower_than" not in by["vram48"]
    by = {r["tier"]: r for r in tier_rows([v32, ours("vram48", 0.372, 20.4)])}
    assert not by["vram48"]["met"] and by["vram48"]["slower_than"] == "vram32"
