"""Capture speed and memory on the meta device: our fx path on GPT-3 175B, the torch.export path on
Hugging Face configs of real size.

    python benchmarks/capture_speed.py                 # every case, one fresh process each
    python benchmarks/capture_speed.py --case fx-gpt3-175b

Cases (batch 1, seq 2048, bf16, no weights anywhere):

    fx-gpt3-175b       autoplan.capture.capture of build_model(gpt3-175b) (96 layers, hidden 12288)
    hf-llama3-8b       autoplan.capture.hf.capture_hf of a LlamaConfig of Llama-3-8B's shape: 2 layers
                       exported, layers 2..31 copied (the default)
    hf-llama3-8b-full  the same with replicate_layers=False: all 32 layers exported
    hf-mixtral-8x7b    capture_hf of MixtralConfig() (Mixtral-8x7B's shape, 32 layers, 8 experts)

Each case runs in a fresh subprocess so that its peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`,
read at its end) is its own: imports, model construction on meta and capture. Columns: seconds to
import (torch + autoplan, + transformers for HF), to build the model on meta (first use in the
process: it includes torch's lazy imports), to capture (trace or export, shapes, costs), and the
process CPU seconds of the capture and of the whole run (the stable figures on a shared machine),
nodes, parameters, forward TFLOP, peak RSS.

Goal (issue 3): fx capture of gpt3-175b under 3 s with peak RSS under 2 GB. Writes
benchmarks/out/capture_speed.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

CASES = ("fx-gpt3-175b", "hf-llama3-8b", "hf-llama3-8b-full", "hf-mixtral-8x7b")
SEQ = 2048
CAPTURE_GOAL_S = 3.0
RSS_GOAL_BYTES = 2 * 1024**3


def run_case(case: str) -> dict:
    """Import, build on meta, capture; figures of this process."""
    start, start_cpu = time.perf_counter(), time.process_time()
    import warnings

    import torch

    import autoplan.capture  # noqa: F401
    if case.startswith("hf-"):
        import transformers

        from autoplan.capture.hf import build_hf_model, capture_hf
    imported = time.perf_counter()
    if case == "fx-gpt3-175b":
        from autoplan.capture import capture
        from autoplan.models import build_model, get_model_config

        config = get_model_config("gpt3-175b")
        model = build_model(config, "meta", torch.bfloat16)
        built, built_cpu = time.perf_counter(), time.process_time()
        graph = capture(model, config, 1, SEQ, torch.bfloat16)
    else:
        hf = (transformers.MixtralConfig() if case == "hf-mixtral-8x7b" else
              transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                       max_position_embeddings=8192, rope_theta=500000.0))
        build_hf_model(hf, torch.bfloat16)  # first construction pays transformers' lazy imports
        built, built_cpu = time.perf_counter(), time.process_time()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ops without a rule: named in the tests, not here
            graph = capture_hf(hf, 1, SEQ, torch.bfloat16, replicate_layers=case != "hf-llama3-8b-full")
    done, done_cpu = time.perf_counter(), time.process_time()
    return {"case": case, "import_s": imported - start, "build_s": built - imported, "capture_s": done - built,
            "capture_cpu_s": done_cpu - built_cpu, "cpu_s": done_cpu - start_cpu, "nodes": len(graph.nodes),
            "layers": len(graph.layers()),
            "parameters": graph.parameter_count(), "fwd_tflop": graph.total_fwd_flops() / 1e12,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_in_subprocess(case: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", case, "--json"], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"case {case} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"capture on meta, batch 1, seq {SEQ}, bf16 (each case a fresh process)")
    for column in ("case", "import s", "build s", "capture s", "capture CPU s", "all CPU s", "nodes", "layers",
                   "params", "fwd TFLOP", "peak RSS MB"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for r in rows:
        table.add_row(r["case"], f"{r['import_s']:.2f}", f"{r['build_s']:.2f}", f"{r['capture_s']:.2f}",
                      f"{r['capture_cpu_s']:.2f}", f"{r['cpu_s']:.1f}", str(r["nodes"]), str(r["layers"]),
                      f"{r['parameters'] / 1e9:.2f}B",
                      f"{r['fwd_tflop']:.1f}", f"{r['peak_rss_bytes'] / 2**20:.0f}")
    console = Console(width=160)
    console.print(table)
    fx = next((r for r in rows if r["case"] == "fx-gpt3-175b"), None)
    if fx is not None:
        ok = fx["capture_s"] < CAPTURE_GOAL_S and fx["peak_rss_bytes"] < RSS_GOAL_BYTES
        console.print(f"goal fx gpt3-175b: capture {fx['capture_s']:.2f} s < {CAPTURE_GOAL_S} s and peak RSS "
                      f"{fx['peak_rss_bytes'] / 2**30:.2f} GB < 2 GB: {'met' if ok else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=CASES, action="append", help="run only these cases")
    parser.add_argument("--json", action="store_true", help="(internal) run one case here, print JSON")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(run_case(args.case[0])))
        return
    rows = [run_in_subprocess(case) for case in args.case or CASES]
    out = Path(__file__).parent / "out"
    out.mkdir(exist_ok=True)
    (out / "capture_speed.json").write_text(json.dumps(rows, indent=2) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
