"""The bundled GPT, the data sampler, the progress-line format and the summary file."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from entrypoints.data import CORPUS_PATH, ByteTokenizer, TokenDataset
from entrypoints.gpt import GPT, Block, GPTConfig, GPTOutput, megatron_flops_per_iteration
from smsdp.util.metric_format import (
    EVAL_LINE_RE,
    METRIC_DEFINITIONS,
    PROGRESS_LINE_RE,
    format_eval_line,
    format_progress_line,
    parse_eval_line,
    parse_progress_line,
)
from smsdp.util.metrics import ProgressLogger, ThroughputMeter, peak_memory_bytes, write_summary
from tests.models import TINY_MODELS, lm_batch, tiny_gpt

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32)


# -- model --------------------------------------------------------------------


def test_forward_shapes_and_initial_loss():
    torch.manual_seed(0)
    model = GPT(SMALL)
    x, y = lm_batch(3, 16, 64, seed=0)
    out = model(x, y)
    assert isinstance(out, GPTOutput)
    assert out.logits.shape == (3, 16, 64)
    assert out.loss.shape == ()
    # Small init: the first prediction is close to uniform over the vocabulary.
    assert abs(out.loss.item() - math.log(64)) < 0.1
    assert model(x).loss is None
    logits, _loss = model(x, y)  # also a plain tuple
    assert torch.equal(logits, out.logits)


def test_shorter_sequences_work_and_longer_ones_are_refused():
    model = GPT(SMALL)
    assert model(torch.zeros(2, 5, dtype=torch.long)).logits.shape == (2, 5, 64)
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_blocks_are_a_module_list_of_block():
    model = GPT(SMALL)
    assert isinstance(model.transformer.h, torch.nn.ModuleList)
    assert [type(b) for b in model.transformer.h] == [Block, Block]


def test_loss_decreases_over_a_few_steps():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SMALL.to_dict(), "vocab_size": 256}))  # every byte
    data = TokenDataset(seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(15):
        x, y = data.batches(step % 3, batch_size=8, seed=0)
        loss = model(x, y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) < sum(losses[:3]) - 1.0, losses


def test_tied_embedding_is_one_parameter():
    model = GPT(SMALL)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert model.num_params() == sum(p.numel() for p in model.parameters())

    untied = GPT(GPTConfig(**{**SMALL.to_dict(), "tie_embeddings": False}))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert untied.num_params() == model.num_params() + 64 * 32


def test_same_seed_same_weights_different_seed_different_weights():
    a, b, c = tiny_gpt(seed=3), tiny_gpt(seed=3), tiny_gpt(seed=4)
    for (name, pa), pb, _pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)


def test_builds_on_meta_and_delayed_init_matches_eager():
    torch.manual_seed(7)
    eager = GPT(SMALL)
    with torch.device("meta"):
        lazy = GPT(SMALL)
    assert all(p.is_meta for p in lazy.parameters())
    assert lazy.num_params() == eager.num_params()
    assert lazy.flops_per_token(16) == eager.flops_per_token(16)

    lazy.to_empty(device="cpu")
    lazy.tie_weights()  # to_empty unties; the model re-ties on request
    torch.manual_seed(7)
    lazy.init_weights()
    assert lazy.lm_head.weight is lazy.transformer.wte.weight
    for (name, pe), pl in zip(eager.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(pe, pl), name


def test_flops_formulas():
    cfg = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, d_model=256)
    model = GPT(cfg)
    n = model.num_params(non_embedding=True)
    assert n == model.num_params() - 128 * 256  # only the position table is dropped when tied
    assert model.flops_per_token(128) == 6 * n + 12 * 4 * 256 * 128
    assert model.flops_per_token() == model.flops_per_token(128)
    # Megatron's per-iteration count agrees with 6N + 12lhs up to biases and LayerNorms.
    per_token = model.megatron_flops_per_iteration(batch_size=8, seq_len=128) / (8 * 128)
    assert per_token == pytest.approx(model.flops_per_token(128), rel=0.01)
    B, s, l, h, V = 2, 64, 3, 48, 100
    assert megatron_flops_per_iteration(B, s, l, h, V, activation_recompute=True) == pytest.approx(
        96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    )


def test_config_validation():
    with pytest.raises(ValueError, match="n_head=3"):
        GPTConfig(d_model=32, n_head=3)
    assert GPTConfig(block_size=64).seq_len == 64


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_tiny_models_are_deterministic_and_train(name):
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
    case = TINY_MODELS[name]
    a, b = case.build(seed=0), case.build(seed=0)
    for (k, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), k
    x, y = lm_batch(4, case.seq_len, case.vocab_size, seed=1)
    loss = case.loss(a, x, y)
    assert abs(loss.item() - math.log(case.vocab_size)) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in a.parameters())


# -- data ---------------------------------------------------------------------


def test_shipped_corpus_size_and_tokenizer_round_trip():
    assert 300_000 <= CORPUS_PATH.stat().st_size <= 1_000_000
    tok = ByteTokenizer()
    text = "déjà vu: 3 ≤ 4\n"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tok.vocab_size == 256


def test_rank_slices_concatenate_to_the_single_process_global_batch():
    data = TokenDataset(seq_len=32)
    for index in (0, 5):
        whole_x, whole_y = data.batches(index, dp_rank=0, dp_size=1, batch_size=12, seed=9)
        for n in (2, 3, 4):
            parts = [data.batches(index, r, n, batch_size=12 // n, seed=9) for r in range(n)]
            assert torch.equal(torch.cat([p[0] for p in parts]), whole_x)
            assert torch.equal(torch.cat([p[1] for p in parts]), whole_y)


def test_batches_are_deterministic_shifted_and_vary_with_seed_and_index():
    data = TokenDataset(seq_len=32)
    x, y = data.batches(3, 1, 2, batch_size=4, seed=1)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    again = TokenDataset(seq_len=32).batches(3, 1, 2, batch_size=4, seed=1)
    assert torch.equal(again[0], x)
    assert not torch.equal(data.batches(3, 1, 2, batch_size=4, seed=2)[0], x)
    assert not torch.equal(data.batches(4, 1, 2, batch_size=4, seed=1)[0], x)
    # Drawing batches does not touch (and is not touched by) the global RNG.
    state = torch.get_rng_state()
    data.batches(0, batch_size=4, seed=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_validation_split_is_held_out(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(97, 123)) * 40)  # 1040 bytes
    data = TokenDataset(tmp_path, seq_len=8, val_fraction=0.25)
    assert data.num_tokens("train") + data.num_tokens("val") == 1040
    val_tail = bytes(data._split("val").tolist())
    x, _ = data.batches(0, batch_size=16, seed=0, split="val")
    for row in x:
        assert bytes(row.tolist()) in val_tail
    with pytest.raises(ValueError, match="split="):
        data.batches(0, split="test")


def test_channel_dir_reads_every_txt_file_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("B" * 200)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("C" * 200)
    (tmp_path / "a.txt").write_text("A" * 200)
    (tmp_path / "notes.md").write_text("ignored")
    data = TokenDataset(str(tmp_path), seq_len=8)
    assert [p.relative_to(tmp_path).as_posix() for p in data.files] == ["a.txt", "b.txt", "sub/c.txt"]
    assert data.num_tokens("train") + data.num_tokens("val") == 3 * 200 + 2  # newline joins


def test_data_errors_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .txt files"):
        TokenDataset(tmp_path)
    (tmp_path / "tiny.txt").write_text("too short")
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(tmp_path, seq_len=64)
    with pytest.raises(ValueError, match="dp_rank=2"):
        TokenDataset(seq_len=8).batches(0, dp_rank=2, dp_size=2)


# -- progress lines -------------------------------------------------------------


def test_progress_line_has_the_documented_shape():
    line = format_progress_line(10, 50, 3.21, 12345.6, 0.012, 1.23 * 1024**3)
    assert line == "[smsdp] step 10/50 loss=3.2100 tokens/s=12345.6 tflops=0.012 mem=1.23GiB"
    assert PROGRESS_LINE_RE.fullmatch(line)
    assert parse_progress_line("[1,0]<stdout>: " + line) == {
        "step": 10,
        "max_steps": 50,
        "loss": 3.21,
        "tokens_per_s": 12345.6,
        "tflops": 0.012,
        "mem_gib": 1.23,
    }
    assert parse_progress_line("[smsdp] something else") is None
    diverged = parse_progress_line(format_progress_line(1, 2, float("nan"), 0.0, 0.0, 0))
    assert math.isnan(diverged["loss"])


def test_metric_definitions_pick_the_right_numbers():
    train = format_progress_line(20, 50, 2.5, 999.0, 1.5, 2 * 1024**3)
    val = format_eval_line(20, 50, 2.75)
    assert EVAL_LINE_RE.fullmatch(val) and parse_eval_line(val)["val_loss"] == 2.75
    expected = {
        "train:loss": "2.5000",
        "train:tokens_per_s": "999.0",
        "train:tflops": "1.500",
        "train:mem_gib": "2.00",
        "val:loss": "2.7500",
    }
    assert {d["Name"] for d in METRIC_DEFINITIONS} == set(expected)
    for definition in METRIC_DEFINITIONS:
        found = [m.group(1) for m in map(re.compile(definition["Regex"]).search, (train, val)) if m]
        assert found == [expected[definition["Name"]]], definition


def test_metric_format_does_not_import_torch():
    code = "import sys, smsdp.util.metric_format; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_throughput_meter_excludes_warmup_and_paused_time():
    clock = FakeClock()
    meter = ThroughputMeter(warmup_steps=2, window=3, clock=clock)
    meter.start()
    for seconds in (5.0, 5.0):  # slow warm-up steps
        clock.now += seconds
        meter.update(100)
    assert meter.tokens_per_s() == pytest.approx(20.0)  # nothing else measured yet
    for _ in range(4):
        clock.now += 1.0
        meter.update(100)
    assert meter.tokens_per_s() == pytest.approx(100.0)
    assert meter.average_tokens_per_s() == pytest.approx(100.0)
    with meter.paused():
        clock.now += 50.0
    clock.now += 0.5
    meter.update(100)
    assert meter.tokens_per_s() == pytest.approx(300 / 2.5)


def test_progress_logger_prints_on_rank0_at_intervals_only():
    clock = FakeClock()
    out = io.StringIO()
    log = ProgressLogger(
        5,
        tokens_per_step=1000,
        flops_per_token=2e9,
        log_interval=2,
        warmup_steps=1,
        rank=0,
        world_size=4,
        stream=out,
        clock=clock,
    )
    log.start()
    for step in range(1, 6):
        clock.now += 0.5
        log.step(step, torch.tensor(4.0 - step))
    log.eval(5, torch.tensor(0.5))
    lines = out.getvalue().splitlines()
    assert [parse_progress_line(l)["step"] for l in lines[:-1]] == [2, 4, 5]
    assert parse_progress_line(lines[1]) == pytest.approx(
        {
            "step": 4,
            "max_steps": 5,
            "loss": 0.0,
            "tokens_per_s": 2000.0,
            "tflops": 4.0,
            "mem_gib": parse_progress_line(lines[1])["mem_gib"],
        }
    )
    assert parse_eval_line(lines[-1])["val_loss"] == 0.5
    summary = log.summary(model_params=7)
    assert summary["final_loss"] == -1.0 and summary["steps"] == 5 and summary["val_loss"] == 0.5
    assert summary["tokens_per_s"] == pytest.approx(2000.0)
    assert summary["tflops_per_rank"] == pytest.approx(1.0)
    assert summary["wall_time_s"] == pytest.approx(2.5) and summary["model_params"] == 7
    assert summary["peak_mem_bytes"] > 0

    quiet = io.StringIO()
    other = ProgressLogger(5, tokens_per_step=1000, log_interval=1, rank=1, stream=quiet)
    assert other.step(1, 1.0) is None and other.eval(1, 1.0) is None
    assert quiet.getvalue() == ""


def test_peak_memory_is_the_process_rss_on_cpu():
    big = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)  # 64 MiB, touched
    assert peak_memory_bytes() >= big.numel()


# -- summary file ---------------------------------------------------------------


def test_write_summary_atomically_replaces_and_leaves_no_temp_files(tmp_path):
    path = write_summary(tmp_path / "out", final_loss=torch.tensor(2.5), steps=3, model_dir=tmp_path)
    assert path == tmp_path / "out" / "summary.json"
    assert json.loads(path.read_text()) == {"final_loss": 2.5, "steps": 3, "model_dir": str(tmp_path)}
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)

    write_summary(path.parent, steps=4)
    assert json.loads(path.read_text()) == {"steps": 4}
    with pytest.raises(TypeError):
        write_summary(path.parent, steps=5, bad=object())
    assert json.loads(path.read_text()) == {"steps": 4}  # a failed write leaves the old file
    assert os.listdir(path.parent) == ["summary.json"]

    explicit = write_summary(tmp_path / "elsewhere" / "run.json", tflops=float("nan"))
    assert math.isnan(json.loads(explicit.read_text())["tflops"])


# -- the training script ------------------------------------------------------------


def test_weight_decay_split_by_name_matches_nanogpt_split_by_rank():
    from entrypoints.train_gpt import param_groups

    model = GPT(SMALL)
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(p) for p in model.parameters() if p.dim() >= 2}
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in model.parameters() if p.dim() < 2}


def test_training_script_runs_as_one_plain_process(tmp_path):
    """``python entrypoints/train_gpt.py`` with the SageMaker variables and a channel."""
    channel = tmp_path / "train"
    channel.mkdir()
    (channel / "text.txt").write_bytes(CORPUS_PATH.read_bytes()[:20_000])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "SMSDP_", "SM_"))}
    env.update(
        SM_CHANNEL_TRAIN=str(channel),
        SM_MODEL_DIR=str(tmp_path / "model"),
        SM_OUTPUT_DATA_DIR=str(tmp_path / "output"),
        OMP_NUM_THREADS="1",
    )
    args = [
        "--max_steps",
        "3",
        "--log_interval",
        "1",
        "--n_layer",
        "1",
        "--d_model",
        "32",
        "--n_head",
        "2",
        "--seq_len",
        "32",
        "--vocab_size",
        "256",
        "--batch_size",
        "2",
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "entrypoints" / "train_gpt.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    progress = [p for p in map(parse_progress_line, proc.stdout.splitlines()) if p]
    assert [p["step"] for p in progress] == [1, 2, 3]
    assert "from 1 file(s)" in proc.stdout

    summary = json.loads((tmp_path / "output" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 1
    assert summary["final_loss"] == pytest.approx(progress[-1]["loss"], abs=1e-4)
    config = GPTConfig(**json.loads((tmp_path / "model" / "config.json").read_text()))
    model = GPT(config)
    model.load_state_dict(torch.load(tmp_path / "model" / "model.pt"))
    assert summary["model_params"] == model.num_params()
    assert sorted(os.listdir(tmp_path / "model")) == ["config.json", "model.pt"]  # no temp files

    # every step ran at the schedule's learning rate (3 steps: all inside the default warm-up)
    from entrypoints.train_gpt import learning_rate, parse_args
    from smsdp.util.metrics_table import parse_table

    rows = parse_table((tmp_path / "output" / "metrics.csv").read_text())
    expected = [learning_rate(step, parse_args(args)) for step in (1, 2, 3)]
    assert [row["lr"] for row in rows] == pytest.approx(expected, rel=1e-12) and expected[0] < expected[-1]
