"""The cases of tests/test_runtime_modules.py and what each rank runs for them (`_ranks`, spawned once per world
size): the case table, the shared constants, and the functions that build, train, evaluate and export a program in
the ranks. Kept apart so that the test module holds the checks and fixtures."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.nn.functional as F
import transformers

from _handmade import HandLM
from _hf_checkpoints import count_checkpoint_reads
from autoplan.errors import PlanError

B, T, STEPS, LR, SEED = 4, 16, 3, 1e-3, 0
# AdamW's eps above the noise of gradients that are zero in exact arithmetic (a key bias: softmax
# ignores a shift shared by all keys), which AdamW would otherwise blow up to +-LR either way
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    model: str  # "llama" | "qwen2" | "hand"
    dp: int = 1
    tp: int = 1
    sp: bool = False
    zero: int = 0
    microbatches: int = 1
    weights: str = "module"  # "module": built with weights; "meta": loaded from the checkpoint
    assignment: str = "megatron"  # "megatron" (with sp: "megatron-sp"), "replicate", "sequence-loss":
    # Megatron with sp, the head and the loss on sequence shards, or "tied-head" (`gpt2_tied_head`)
    recompute: str = "none"  # the plan's recompute policy (runtime.module_recompute)
    pp: int = 1
    schedule: str = "1f1b"
    stage_layers: tuple[int, ...] | None = None  # None: as the planner cuts them

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def virtual(self) -> int:
        return len(self.stage_layers) // self.pp if self.stage_layers else 1


CASES = [
    Case("llama-dp2", "llama", dp=2, microbatches=2),
    Case("llama-tp2", "llama", tp=2, weights="meta"),
    Case("llama-tp2-sp", "llama", tp=2, sp=True),
    Case("llama-dp2-zero3", "llama", dp=2, zero=3, weights="meta"),
    Case("qwen2-dp2", "qwen2", dp=2, weights="meta"),
    Case("qwen2-tp2", "qwen2", tp=2),
    Case("qwen2-tp2-sp", "qwen2", tp=2, sp=True, weights="meta"),
    Case("qwen2-dp2-zero3", "qwen2", dp=2, zero=3),
    Case("hand-tp2-sp", "hand", tp=2, sp=True),
    Case("llama-tp2-sequence-loss", "llama", tp=2, sp=True, assignment="sequence-loss"),
    Case("qwen2-tp2-replicated", "qwen2", tp=2, assignment="replicate"),
    Case("llama-dp2tp2-sp", "llama", dp=2, tp=2, sp=True, weights="meta"),
    Case("qwen2-dp2tp2-zero3", "qwen2", dp=2, tp=2, zero=3),
    Case("hand-dp2tp2-zero1", "hand", dp=2, tp=2, zero=1),
    # ZeRO 1 / 2: the distributed optimizer of runtime.grad_sync (sp: Partial gradients settled first)
    Case("llama-dp2-zero1", "llama", dp=2, zero=1, microbatches=2),
    Case("qwen2-dp2tp2-sp-zero2", "qwen2", dp=2, tp=2, sp=True, zero=2),
    # row-parallel slices read from the checkpoint are strided: FSDP2 must get them contiguous
    Case("llama-dp2tp2-zero1-meta", "llama", dp=2, tp=2, zero=1, weights="meta"),
    Case("gpt2-dp2", "gpt2", dp=2, microbatches=2),
    Case("gpt2-tp2", "gpt2", tp=2, assignment="tied-head"),
    Case("gpt2-dp2-zero3-meta", "gpt2", dp=2, zero=3, weights="meta"),
    Case("gpt2-dp2tp2-zero3", "gpt2", dp=2, tp=2, zero=3, assignment="tied-head", weights="meta"),
    # recompute: each mirrors a case above (BASES) but for its policy, so its activation bytes compare
    Case("llama-dp2-full", "llama", dp=2, microbatches=2, recompute="full"),
    Case("qwen2-tp2-sp-selective", "qwen2", tp=2, sp=True, weights="meta", recompute="selective"),
    Case("hand-tp2-sp-full:1", "hand", tp=2, sp=True, recompute="full:1"),
    Case("llama-tp2-matmul-only", "llama", tp=2, recompute="matmul-only"),
    Case("qwen2-dp2tp2-zero3-selective", "qwen2", dp=2, tp=2, zero=3, recompute="selective"),
    Case("gpt2-dp2-selective", "gpt2", dp=2, microbatches=2, recompute="selective"),
    # pipelines: stages cut at block boundaries (runtime.module_pipeline)
    Case("llama-pp2", "llama", pp=2, microbatches=2, weights="meta"),
    Case("llama-pp2dp2-zero1", "llama", pp=2, dp=2, zero=1, microbatches=2),
    Case("llama-pp2tp2-sp", "llama", pp=2, tp=2, sp=True, microbatches=2, schedule="gpipe"),
    Case("qwen2-pp2-interleaved", "qwen2", pp=2, microbatches=2, schedule="interleaved-1f1b",
         stage_layers=(0, 1, 1, 0)),
    Case("qwen2-pp2dp2-interleaved-zero1", "qwen2", pp=2, dp=2, zero=1, microbatches=2,
         schedule="interleaved-1f1b", stage_layers=(0, 1, 1, 0)),
    Case("hand-pp2", "hand", pp=2, microbatches=4),
    Case("hand-pp2dp2", "hand", pp=2, dp=2, microbatches=2),
    Case("hand-pp2tp2", "hand", pp=2, tp=2, microbatches=2),
    # recompute on the blocks a pipeline rank holds, by the model's layer indices
    Case("llama-pp2-full", "llama", pp=2, microbatches=2, recompute="full"),
    Case("qwen2-pp2tp2-selective", "qwen2", pp=2, tp=2, microbatches=2, recompute="selective"),
]
BASES = {"llama-dp2-full": "llama-dp2", "qwen2-tp2-sp-selective": "qwen2-tp2-sp",
         "hand-tp2-sp-full:1": "hand-tp2-sp", "llama-tp2-matmul-only": "llama-tp2",
         "gpt2-dp2-selective": "gpt2-dp2"}
EXPORTED = ("llama-dp2tp2-sp", "qwen2-dp2tp2-zero3", "gpt2-dp2tp2-zero3", "llama-pp2dp2-zero1")


def _hand_model(device: str = "cpu") -> HandLM:
    torch.manual_seed(SEED)
    with torch.device(device):
        return HandLM()


# ------------------------------------------------------------------------------- in the ranks


def _build(case: Case, dirs: dict):
    if case.model == "hand":
        return _hand_model(), None
    if case.weights == "meta":
        config = transformers.AutoConfig.from_pretrained(dirs[case.model])
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), dirs[case.model]
    return transformers.AutoModelForCausalLM.from_pretrained(dirs[case.model], attn_implementation="sdpa"), None


def _local_numel(program) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in program.model.parameters())


def _train(program, tokens: torch.Tensor, keep: bool) -> dict:
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    losses, grads = [], None
    for step in range(STEPS):
        targets = tokens[step].roll(-1, dims=1)
        targets[:, -1] = -100  # transformers' loss: T - 1 targets per row
        losses.append(program.train_step(tokens[step], targets, optimizer))
        if step == 0:
            grads, norm = program.full_gradients(), program.grad_norm
    params = program.full_parameters()
    return {"losses": losses, "grads": grads if keep else None, "params": params if keep else None,
            "grad_norm": norm}


def _activations(program, tokens: torch.Tensor) -> dict:
    """What one microbatch's forward leaves for backward on this rank (runtime.memory_probe), and the
    save / recompute decisions of the recomputed blocks, as {"family:saved": ops}. Its gradients are
    dropped by the first train_step (zero_grad)."""
    from autoplan.runtime.memory_probe import measure_saved_bytes
    from autoplan.runtime.recompute import observe_recompute

    rows = program._rows(tokens)[:program.plan.microbatch_size]
    targets = rows.roll(-1, dims=1)
    targets[:, -1] = -100
    with program._loss_context(), observe_recompute() as decisions:
        _, measured = measure_saved_bytes(lambda: program._token_loss_sum(rows, targets), program.model)
    return {"saved_bytes": measured.saved_bytes,
            "decisions": {f"{family}:{saved}": n for (family, saved), n in decisions.items()}}


def _held_layers(program) -> dict:
    """The layers whose blocks this rank holds, and the paths of other stages' stand-ins whose forward
    was replaced (none may be: a stand-in is never a recomputed region)."""
    if program.plan.mesh.pp == 1:
        return {"held_layers": tuple(range(program.plan.model.num_layers)), "wrapped_stand_ins": []}
    blocks = program.cut.held_blocks()
    return {"held_layers": tuple(i for i, b in enumerate(blocks) if b is not None),
            "wrapped_stand_ins": [p.path for p, b in zip(program.cut.blocks, blocks)
                                  if b is None and "forward" in vars(p.module)]}


def _trained_decisions(program, tokens: torch.Tensor, keep: bool) -> dict:
    """`_train`, counting the save / recompute decisions of the recomputed blocks over its steps."""
    from autoplan.runtime.recompute import observe_recompute

    with observe_recompute() as decisions:
        found = _train(program, tokens, keep)
    return found | {"decisions": {f"{family}:{saved}": n for (family, saved), n in decisions.items()}}


def _evaluate(program, tokens: torch.Tensor) -> dict:
    """This rank's logits, all logits, and the loss of the gathered logits on new tokens; with a
    pipeline, forward's refusal and eval_loss alone."""
    targets = tokens.roll(-1, dims=1)
    targets[:, -1] = -100
    if program.plan.mesh.pp > 1:
        try:
            program.forward(tokens)
            refused = ""
        except PlanError as exc:
            refused = str(exc)
        loss = program.eval_loss(tokens, targets)
        return {"refused": refused, "after": loss, "eval": loss}
    local = program.forward(tokens)
    logits = program.forward(tokens, gather=True)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).item()
    return {"local_shape": tuple(local.shape), "gathered_shape": tuple(logits.shape), "after": loss,
            "eval": program.eval_loss(tokens, targets)}


def _run_case(rank: int, case: Case, plan, setup_: dict) -> dict:
    import autoplan
    from autoplan.runtime.hf_export import save_hf

    reads: list[int] = []
    count_checkpoint_reads(reads)
    model, checkpoint = _build(case, setup_["dirs"])
    if case.name == "llama-tp2":  # the checkpoint directory itself as the model
        model, checkpoint = str(setup_["dirs"]["llama"]), None
    program = autoplan.parallelize(model, f"1x{case.world}xcpu", plan, checkpoint=checkpoint)
    held = _local_numel(program)
    found = {"reads": sum(reads), "held": held, "table": str(program.module_plan),
             "recomputed": program.recomputed_layers} | _held_layers(program)
    if case.pp > 1 and case.recompute != "none":  # no single-microbatch forward: the decisions of training
        found |= _trained_decisions(program, setup_["tokens"], keep=rank == 0)
    else:
        if case.name in BASES or case.name in BASES.values() or case.recompute != "none":
            found |= _activations(program, setup_["tokens"][0])
        found |= _train(program, setup_["tokens"], keep=rank == 0)
    found |= _evaluate(program, setup_["tokens"][STEPS])
    if case.name in EXPORTED:
        save_hf(program, setup_["root"] / f"export-{case.name}")
        save_hf(program, setup_["root"] / f"export-{case.name}")  # replaces its own earlier export
    return found


def _refused_export(rank: int, setup_: dict) -> str:
    from autoplan.errors import ConfigError
    from autoplan.runtime.hf_export import save_hf
    from autoplan.runtime.module_launch import parallelize_module_program

    case = Case("llama-dp2-export", "llama", dp=2)
    program = parallelize_module_program(_build(case, setup_["dirs"])[0], setup_["plans"]["llama-dp2"])
    try:
        save_hf(program, setup_["root"] / "users-dir")
    except ConfigError as exc:
        return str(exc)
    return ""


def _diverged(rank: int, setup_: dict) -> dict:
    """A NaN in rank 1's lm_head (dp2, ZeRO 0): every rank refuses the step; no update taken."""
    from autoplan.errors import TrainingDivergedError
    from autoplan.runtime.module_launch import parallelize_module_program

    case = Case("llama-dp2-nan", "llama", dp=2)
    program = parallelize_module_program(_build(case, setup_["dirs"])[0], setup_["plans"]["llama-dp2"])
    optimizer = program.make_optimizer(torch.optim.AdamW, lr=LR, eps=EPS)
    if rank == 1:
        with torch.no_grad():
            program.model.lm_head.weight[0, 0] = float("nan")
    before = program.model.model.embed_tokens.weight.detach().clone()
    tokens = setup_["tokens"][0]
    try:
        program.train_step(tokens, tokens.roll(-1, dims=1), optimizer)
    except TrainingDivergedError as exc:
        same = torch.equal(before, program.model.model.embed_tokens.weight.detach())
        return {"error": str(exc), "parameter": exc.parameter, "unchanged": same}
    return {"error": ""}


def _unplanned(rank: int, setup_: dict) -> list[float]:
    import autoplan

    model = transformers.AutoModelForCausalLM.from_pretrained(setup_["dirs"]["llama"], attn_implementation="sdpa")
    program = autoplan.parallelize(model, "1x2xcpu", global_batch=B, seq_len=T)
    return _train(program, setup_["tokens"], keep=False)["losses"]


def _ranks(rank: int, world: int, names: list[str], setup_: dict) -> dict:
    warnings.simplefilter("ignore")
    cases = {c.name: c for c in CASES}
    found = {name: _run_case(rank, cases[name], setup_["plans"][name], setup_) for name in names}
    if world == 2:
        found["refused"] = _refused_export(rank, setup_)
        found["diverged"] = _diverged(rank, setup_)
        found["unplanned"] = _unplanned(rank, setup_)
    return found
