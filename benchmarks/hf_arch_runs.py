"""The architectures of `hf_architectures.py` run at tiny size on 2 gloo ranks (issue 21's "runs" column).

For each architecture of `hf_architectures.ARCHITECTURES` (one list) a tiny config of the same config class
(`tiny_config`: hidden 64, 2 layers, 4 heads, vocab 256, a window of 8 where the model has one, 4 experts
where it has experts; the real config's features kept: fused QKV, q/k norms, partial rotary, tied
embeddings, shared experts, ...) is built, seeded and saved with `save_pretrained`. transformers trains it
in one process (3 AdamW steps, loss `model(input_ids, labels=input_ids).loss`); then autoplan plans it for
2 ranks and runs it on 2 gloo ranks with

    dp2   the batch split over 2 ranks, every op replicated
    tp2   Megatron's assignment of the planner (`megatron_assignment`): attention split on heads, MLPs
          column / row, the embedding and loss vocab-parallel, where the rules allow; what they do not
          shard stays replicated

each loading its weights from the checkpoint directory (`autoplan.parallelize(directory, ...)`), and
compares: losses within rel 1e-5 (the first is transformers' own loss on the same weights), the first
step's gradients and the final parameters within rel 1e-5 (atol 1e-5). A row is "ok", or the first line
of what stopped it (a plan refused, a mismatch, an error raised in a rank).

One exception to the parameters' tolerance, AdamW's own: an element whose reference gradient g was at
some step nonzero but near eps (0 < |g| < NEAR_EPS eps) moves by lr m / (sqrt(v) + eps), whose derivative
in g is up to lr / eps (at |g| << eps; a tenth of it at |g| = 10 eps), so a float difference d of its
gradient (the order of the reduction under tp: 1e-8 to 1e-7 absolute where the tensor's gradients are
1e-2) moves it by up to lr d / eps = 1e3 d, above the 1e-5 tolerance.
Such elements are compared with that amplification's tolerance, STEPS lr d / eps, d the largest
difference of the first step's gradients (`noise_tolerance`); every other element, the losses and the
first gradients with rel 1e-5. Measured on Qwen3-MoE tp2 (the row it was written for): embedding element (49, 17), whose
only nonzero gradient (step 2) is 2.0e-8 in one process and 5.7e-8 under tp2, ends 3.0e-5 apart; element
(180, 2), 3.95e-6 and 3.79e-6, ends 1.1e-5 apart (its value 0.025: rel 1e-5 and atol 1e-5 allow 1.03e-5).

    .venv/bin/python benchmarks/hf_architectures.py --runs [--only gemma,phi] [--json runs.json]
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autoplan.errors import PlanError

WORLD, B, T, STEPS, LR, SEED = 2, 4, 16, 3, 1e-3, 0
EPS = 1e-6  # AdamW's eps above the noise of gradients zero in exact arithmetic (tests/test_runtime_modules.py)
TOL = dict(rtol=1e-5, atol=1e-5)
NEAR_EPS = 10  # a gradient below NEAR_EPS * EPS: AdamW's update still moves ~1 / eps per unit of its noise
CASES = ("dp2", "tp2")

# tiny values by config key, applied where the real config has the key (a value of None stays None)
TINY = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "word_embed_proj_dim": 64,
        "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "num_hidden_layers": 2, "n_layer": 2, "num_attention_heads": 4, "n_head": 4, "head_dim": 16,
        "vocab_size": 256, "max_position_embeddings": 64, "n_positions": 64, "sliding_window": 8,
        "num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "rotary_dim": 8}


def tiny_config(model_type: str, kwargs: dict, name: str):
    """The tiny config of an architecture (module docstring): its real config's keys set to `TINY`'s
    values where the real one has them, kv heads kept as "all", "one" or "a group of two", every dropout
    off (the parity is of deterministic steps)."""
    from hf_architectures import hf_config

    real = hf_config(model_type, kwargs, name).to_dict()
    tiny = dict(kwargs) | {k: v for k, v in TINY.items() if real.get(k) is not None}
    heads, kv = real.get("num_attention_heads") or real.get("n_head"), real.get("num_key_value_heads")
    if kv is not None:
        tiny["num_key_value_heads"] = 4 if kv == heads else (1 if kv == 1 else 2)
    if real.get("head_dim") is not None and real.get("head_dim") == real.get("qk_rope_head_dim"):
        tiny["head_dim"] = TINY["qk_rope_head_dim"]  # DeepSeek: the rotary tables' width
    tiny |= {k: 0 for k, v in real.items() if k.endswith("_token_id") and isinstance(v, int) and v >= TINY["vocab_size"]}
    tiny |= {k: 0.0 for k, v in real.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float)}
    return hf_config(model_type, tiny, f"tiny-{name}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def reference(model, tokens: torch.Tensor) -> dict:
    """transformers in one process: STEPS AdamW steps; losses, the first step's gradients, the parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, grads = [], None
    below_eps = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = _hf_loss(model, tokens[step])
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            below_eps[n] |= (p.grad != 0) & (p.grad.abs() < NEAR_EPS * EPS)
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "below_eps": below_eps,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def save_checkpoint(config, directory: Path, tokens: torch.Tensor) -> dict:
    """The seeded model of `config` saved to `directory`, and its reference run (after saving)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return reference(model, tokens)


def case_plan(case: str, config) -> tuple:
    """(plan, regions replicated) of `case` ("dp2" or "tp2") for the tiny model of `config`, captured at
    B x T. tp2: Megatron's assignment, with each region (a parent module of linears) that the module
    runtime refuses to split (`check_module_plan`'s PlanError names it) planned replicated instead."""
    from autoplan.capture.hf import build_hf_model, capture_hf_for_planner
    from autoplan.capture.hf_rules import hf_registry
    from autoplan.runtime.module_launch import check_module_plan
    from autoplan.solver.intra_op import megatron_assignment
    from autoplan.strategies import strategy_info

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary, graph, _ = capture_hf_for_planner(config, T, "float32")
    tp = 2 if case == "tp2" else 1
    registry, info = hf_registry(), strategy_info(summary.rule_info(), tp, tp)
    assignment = megatron_assignment(graph, registry, tp, info, False) if tp > 1 else {}
    model, replicated = build_hf_model(config, torch.float32), []
    for _ in range(len(graph.nodes)):
        plan = _plan(graph, summary, tp, assignment, registry)
        try:
            check_module_plan(plan, model)
            return plan, replicated
        except PlanError as exc:
            region = _refused_region(str(exc), model)
            if region is None or region in replicated:
                raise
            replicated.append(region)
            assignment |= {n.name: "replicate" for n in graph.nodes
                           if n.module_path == region or n.module_path.startswith(region + ".")}
    raise AssertionError("unreachable: every region replicated")


def _plan(graph, summary, tp: int, assignment: dict, registry):
    from autoplan.api import plan_from_assignment
    from autoplan.cluster import parse_cluster
    from autoplan.mesh import MeshShape

    mesh = MeshShape(dp=WORLD // tp, tp=tp)
    return plan_from_assignment(graph, summary, parse_cluster(f"1x{WORLD}xcpu"), mesh, assignment,
                                B // mesh.dp, 1, 0, "none", registry=registry, dtype="float32")


def _refused_region(message: str, model) -> str | None:
    """The region of the first module a refusal names: that module where it has submodules (an attention,
    MLP or MoE module), else (a linear, a norm) its parent."""
    import re

    modules = dict(model.named_modules())
    found = next((m for m in re.findall(r"'([\w.]+)'", message) if m in modules and m), None)
    if found is None:
        return None
    return found if any(True for _ in modules[found].children()) else found.rpartition(".")[0] or None


def train(program, tokens: torch.Tensor) -> dict:
    """STEPS steps of a program on transformers' targets (the next token, T - 1 per row)."""
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, grads = [], None
    for step in range(STEPS):
        targets = tokens[step].roll(-1, dims=1)
        targets[:, -1] = -100
        losses.append(program.train_step(tokens[step], targets, optimizer))
        if step == 0:
            grads = program.full_gradients()
    return {"losses": losses, "grads": grads, "params": program.full_parameters()}


def _rank(rank: int, port: int, directory: str, plan, tokens: torch.Tensor, out: str) -> None:
    import autoplan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        program = autoplan.parallelize(directory, f"1x{WORLD}xcpu", plan, timeout_s=120)
        found = {"ok": train(program, tokens)}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the row's error
        found = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    torch.save(found, Path(out) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(directory: Path, plan, tokens: torch.Tensor) -> dict:
    """Rank 0's result of `train` under `plan` on WORLD gloo ranks, or {"error": ...} of the first rank
    that failed."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(_free_port(), str(directory), plan, tokens, out), nprocs=WORLD,
                           start_method="spawn")
        found = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    failed = [f for f in found if "error" in f]
    return failed[0] if failed else found[0]["ok"]


def compare(got: dict, ref: dict) -> str | None:
    """None when `got` matches the reference (module docstring), else the first mismatch."""
    try:
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=TOL["rtol"],
                                   atol=0, msg=lambda m: f"losses {got['losses']} vs {ref['losses']}")
        for what in ("grads", "params"):
            missing = set(ref[what]) ^ set(got[what])
            if missing:
                return f"{what}: names differ from transformers' ({sorted(missing)[:4]})"
            noise_atol = noise_tolerance(got, ref) if what == "params" else 0.0  # the gradients checked first
            for name, value in got[what].items():
                _assert_close(what, name, value, ref[what][name], ref["below_eps"][name] if what == "params" else None,
                              noise_atol)
    except AssertionError as exc:
        return f"mismatch: {str(exc).splitlines()[0]}"
    return None


def noise_tolerance(got: dict, ref: dict) -> float:
    """STEPS lr d / eps: how far AdamW can move an element whose gradient is below eps for a float
    difference d of its gradients (module docstring), d the first step's largest."""
    noise = max(float((got["grads"][n] - g).abs().max()) for n, g in ref["grads"].items())
    return STEPS * LR * noise / EPS


def _assert_close(what: str, name: str, value, expected, below_eps, noise_atol: float) -> None:
    """rel 1e-5 (TOL), except the elements `below_eps` marks: within `noise_atol`."""
    usual = torch.ones_like(value, dtype=torch.bool) if below_eps is None else ~below_eps
    torch.testing.assert_close(value[usual], expected[usual], **TOL, msg=lambda m: f"{what} {name}: {m.splitlines()[0]}")
    if below_eps is not None:
        torch.testing.assert_close(value[below_eps], expected[below_eps], rtol=0, atol=max(noise_atol, TOL["atol"]),
                                   msg=lambda m: f"{what} {name} (gradients below eps): {m.splitlines()[0]}")


def run_architecture(name: str, root: Path) -> dict:
    """{"dp2": "ok" or the error's first line, "tp2": ...} for one architecture of the list."""
    from hf_architectures import ARCHITECTURES

    model_type, _, kwargs = ARCHITECTURES[name]
    tokens = torch.randint(0, TINY["vocab_size"], (STEPS, B, T), generator=torch.Generator().manual_seed(SEED))
    row: dict = {}
    try:
        config = tiny_config(model_type, kwargs, name)
        directory = root / model_type
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = save_checkpoint(config, directory, tokens)
    except Exception as exc:  # noqa: BLE001 - the row reports whatever stops an architecture
        return {case: f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}" for case in CASES}
    for case in CASES:
        try:
            plan, replicated = case_plan(case, config)
            if replicated:
                row[f"{case}_replicated"] = replicated
            got = run_ranks(directory, plan, tokens)
            row[case] = got["error"].splitlines()[0][:300] if "error" in got else (compare(got, ref) or "ok")
            if "traceback" in got:
                row[f"{case}_traceback"] = got["traceback"]
        except Exception as exc:  # noqa: BLE001
            row[case] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            row[f"{case}_traceback"] = traceback.format_exc()
    return row


def runs_cell(row: dict) -> str:
    """The README's "runs" cell of a row: "yes (dp2, tp2)" (with the regions tp2 kept replicated), or each
    failing case's first line."""
    ok = [c + _replicated_note(row.get(f"{c}_replicated", ())) for c in CASES if row.get(c) == "ok"]
    errors = {row[c] for c in CASES if c in row and row[c] != "ok"}
    if not ok and len(errors) == 1:  # refused before any case ran (the config)
        return f"no: {errors.pop()[:160]}"
    failed = [f"{c}: {row[c][:160]}" for c in CASES if c in row and row[c] != "ok"]
    return "; ".join(([f"yes ({', '.join(ok)})"] if ok else []) + (["no " + f for f in failed]))


def _replicated_note(regions) -> str:
    """" with self_attn replicated": the kinds of region a plan kept replicated (`replicated_kinds`)."""
    kinds = sorted(replicated_kinds(regions))
    return f" with {', '.join(kinds)} replicated" if kinds else ""


def replicated_kinds(regions) -> set[str]:
    """The last path component of each region ("self_attn", "mlp"), or "layers.*" for a whole layer."""
    kinds = set()
    for region in regions:
        parent, _, last = region.rpartition(".")
        kinds.add(f"{parent.rpartition('.')[2]}.*" if last.isdigit() else last)
    return kinds
