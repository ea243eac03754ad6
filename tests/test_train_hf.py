"""`autoplan.train --hf-model DIR --save-hf OUT` under torchrun on 2 gloo ranks, against transformers
in this process: the first logged loss is transformers' loss of the checkpoint's weights on the
first batch, and the exported OUT, loaded with from_pretrained, gives the run's final `eval_loss`
(the trained weights on the batch after the last step). Options the module runtime does not run
yet are refused before anything starts (in process: no ranks needed for that)."""

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


@pytest.mark.gloo
def test_fine_tune_and_export_loads_in_transformers(checkpoint, tmp_path, free_port):
    out, log = tmp_path / "tuned", tmp_path / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "autoplan.train", "--hf-model", str(checkpoint), "--global-batch", str(BATCH), "--seq", str(SEQ),
           "--steps", str(STEPS), "--lr", "3e-3", "--save-hf", str(out), "--log-json", str(log)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plan: " in result.stdout and "wrote the fine-tuned checkpoint" in result.stdout
    record = json.loads(log.read_text())
    assert len(record["losses"]) == STEPS and record["model"] == str(checkpoint)
    assert record["losses"][0] == pytest.approx(_loss(checkpoint, 0), rel=1e-5)  # the checkpoint's own weights
    assert record["losses"][-1] < record["losses"][0]
    assert _loss(out, STEPS) == pytest.approx(record["eval_loss"], abs=1e-5)
    assert (out / ".autoplan-export").is_file() and not list(tmp_path.glob("tuned.*"))


@pytest.mark.parametrize("argv, expected", [
    (["--save", "ckpt"], "--save: DCP checkpoints (with the optimizer state) run for the zoo models only"),
    (["--resume", "ckpt"], "not with --hf-model; write the weights with --save-hf OUT"),
    (["--save-hf", "{checkpoint}"], "a non-empty directory autoplan did not write"),
])
def test_what_the_module_runtime_does_not_run_is_refused_first(checkpoint, capsys, argv, expected):
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
