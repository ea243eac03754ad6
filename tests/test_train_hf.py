"""`autoplan.train --hf-model DIR --save-hf OUT` under torchrun on 2 gloo ranks, against transformers
in this process: the first logged loss is transformers' loss of the checkpoint's weights on the
first batch, and the exported OUT, loaded with from_pretrained, gives the run's final `eval_loss`
(the trained weights on the batch after the last step). The same run saves DCP checkpoints with
`--save DIR --save-every 2`; `--resume DIR/step-000002` then gives its losses of steps 2 and 3 and its
final eval_loss (the optimizer state came back too; tests/test_module_checkpoint.py resumes under
other plans). A --save-hf OUT
autoplan may not write is refused before anything starts (in process: no ranks needed for that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

BATCH, SEQ, STEPS, VOCAB = 4, 16, 4, 128


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from autoplan.examples.tiny_hf import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny", layers=2, hidden=64, vocab=VOCAB)


def _loss(directory, step: int) -> float:
    """transformers' model from `directory`: mean cross-entropy of batch `step` of the training data
    against its next tokens (autoplan.train's synthetic stream, seed 0)."""
    from autoplan.train import batch_at, token_stream

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    tokens, targets = batch_at(token_stream(VOCAB, None, 0), step, BATCH, SEQ)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def _train(checkpoint, cwd, port: int, steps: int, *options: str) -> dict:
    """autoplan.train --hf-model `checkpoint` on 2 ranks for `steps` steps; its --log-json record."""
    log = cwd / f"log-{len(list(cwd.glob('log-*')))}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "autoplan.train", "--hf-model", str(checkpoint), "--global-batch", str(BATCH), "--seq", str(SEQ),
           "--steps", str(steps), "--lr", "3e-3", "--log-json", str(log), *options]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(log.read_text()) | {"stdout": result.stdout}


@pytest.fixture(scope="module")
def tuned(checkpoint, tmp_path_factory):
    """The run without a restart, exporting its weights and saving DCP checkpoints at steps 2 and 4:
    (its record, the export, the directory)."""
    from _dist import _free_port

    where = tmp_path_factory.mktemp("tuned")
    options = ("--save-hf", str(where / "tuned"), "--save", str(where / "ckpt"), "--save-every", "2")
    return _train(checkpoint, where, _free_port(), STEPS, *options), where / "tuned", where


@pytest.mark.gloo
def test_fine_tune_and_export_loads_in_transformers(checkpoint, tuned):
    record, out, where = tuned
    assert "plan: " in record["stdout"] and "wrote the fine-tuned checkpoint" in record["stdout"]
    assert len(record["losses"]) == STEPS and record["model"] == str(checkpoint)
    assert record["losses"][0] == pytest.approx(_loss(checkpoint, 0), rel=1e-5)  # the checkpoint's own weights
    assert record["losses"][-1] < record["losses"][0]
    assert _loss(out, STEPS) == pytest.approx(record["eval_loss"], abs=1e-5)
    assert (out / ".autoplan-export").is_file() and not list(where.glob("tuned.*"))


@pytest.mark.gloo
def test_save_and_resume_give_the_uninterrupted_losses(checkpoint, tuned, tmp_path, free_port):
    saves = tuned[2] / "ckpt"
    assert sorted(p.name for p in saves.iterdir()) == ["step-000002", "step-000004"]
    resumed = _train(checkpoint, tmp_path, free_port(), STEPS, "--resume", str(saves / "step-000002"))
    assert resumed["first_step"] == 2 and len(resumed["losses"]) == STEPS - 2
    assert resumed["losses"] == pytest.approx(tuned[0]["losses"][2:], rel=1e-5, abs=1e-5)
    assert resumed["eval_loss"] == pytest.approx(tuned[0]["eval_loss"], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("argv, expected", [
    (["--save-hf", "{checkpoint}"], "a non-empty directory autoplan did not write"),
])
def test_an_export_onto_a_users_directory_is_refused_first(checkpoint, capsys, argv, expected):
    from autoplan.train import main

    argv = [a.format(checkpoint=checkpoint) for a in argv]
    assert main(["--hf-model", str(checkpoint), *argv]) == 2
    assert expected in capsys.readouterr().err
    assert sorted(p.name for p in checkpoint.iterdir()) == [".autoplan-example", "config.json",
                                                           "generation_config.json", "model.safetensors"]


def test_save_hf_needs_a_hugging_face_model(capsys):
    from autoplan.train import main

    assert main(["--model", "tiny-gpt", "--save-hf", "out"]) == 2
    assert "--save-hf out: exports a Hugging Face model trained with --hf-model DIR" in capsys.readouterr().err
