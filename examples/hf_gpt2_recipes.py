"""Train a HuggingFace GPT-2 three ways on the same batches and print a loss table (issue 36):

- ``stock``: ``GPT2LMHeadModel`` as ``transformers`` builds it (pre-LN, shortcuts, its own init, tied head);
- ``keep``: recipe 1, the same architecture with sigprop's answer applied (shaped attention, the
  activation transformed, norms at the identity, the head untied);
- ``norm-free``: recipe 2, ``normalization_free(model)`` (no norms, no shortcuts) solved and applied.

The text is the worker's charlm corpus (Python's standard-library sources read as bytes, nothing
downloaded; ``sigprop.worker.charlm_corpus``), the vocabulary the 256 byte values. Every arm trains
for the same steps on the same random windows with Adam, a linear warm-up over the first 5% of steps
then cosine decay to zero, and gradient clipping at norm 1 (the charlm validation's schedule);
dropout is off everywhere. The table gives the next-byte cross-entropy in nats on fixed validation
windows at a few step counts, per learning rate and arm.

Run: python examples/hf_gpt2_recipes.py --threads 1  (defaults: about 4 minutes on 2 busy CPU cores)
     python examples/hf_gpt2_recipes.py --help
Needs ``pip install 'sigprop[hf]'`` (transformers).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
import transformers

import sigprop
from sigprop.client.torch import apply, graph_from_module, normalization_free
from sigprop.worker.charlm_corpus import VOCAB_SIZE, load_corpus

ARMS = ("stock", "keep", "norm-free")


def gpt2(args) -> transformers.GPT2LMHeadModel:
    cfg = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.heads, n_inner=4 * args.width,
        n_positions=args.seq_len, vocab_size=VOCAB_SIZE, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return transformers.GPT2LMHeadModel(cfg)


def make_arm(name: str, args, ids: torch.Tensor, solved: dict) -> transformers.GPT2LMHeadModel:
    """One arm's model: the stock GPT-2, or a recipe solved by sigprop (once per arm, kept in
    ``solved``) and applied."""
    model = gpt2(args)
    if name == "stock":
        return model
    if name == "norm-free":
        model = normalization_free(model).model  # its report names the norms and shortcuts removed
    if name not in solved:
        graph = graph_from_module(model, ids)
        targets = {"zeta": args.zeta} if args.method == "dks" else {"tau": args.tau}
        solved[name] = sigprop.solve(graph, args.method, "gelu_tanh", targets, attention={"shaping": args.shaping})
    return apply(model, solved[name], example_input=ids, seed=args.seed).model  # a GPT2LMHeadModel


def windows(text: torch.Tensor, starts: np.ndarray, length: int) -> torch.Tensor:
    """Byte windows of ``length + 1`` (inputs and their next bytes) starting at ``starts``."""
    return text[torch.from_numpy(starts[:, None] + np.arange(length + 1)[None, :])].long()


def evaluate(model, val: torch.Tensor) -> float:
    """Mean next-byte cross-entropy (nats) on the validation windows."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=val[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), val[:, 1:].reshape(-1))
    model.train()
    return float(loss)


def train(model, train_text: torch.Tensor, val: torch.Tensor, lr: float, args, report_at: list[int]) -> dict:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    warmup = max(1, round(0.05 * args.steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, args.steps - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    rng = np.random.default_rng(args.seed + 1)  # the same batches for every arm
    out = {0: evaluate(model, val)}
    model.train()
    for step in range(1, args.steps + 1):
        batch = windows(train_text, rng.integers(0, len(train_text) - args.seq_len - 1, args.batch), args.seq_len)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if not math.isfinite(float(loss.detach())):
            out[step] = float("nan")
            break
        if step in report_at:
            out[step] = evaluate(model, val)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lrs", default="1e-3,3e-3", help="Adam learning rates, comma-separated")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    p.add_argument("--method", default="dks", choices=("dks", "tat"))
    p.add_argument("--zeta", type=float, default=1.5, help="DKS's target slope")
    p.add_argument("--tau", type=float, default=0.3, help="TAT's target for the smooth gelu_tanh")
    p.add_argument("--shaping", default="e-spa", help="e-spa, u-spa, value-skipinit or shaped")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--points", type=int, default=4, help="step counts in the table (evenly spaced)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    lrs = [float(v) for v in args.lrs.split(",")]
    arms = [a for a in args.arms.split(",") if a]
    if unknown := set(arms) - set(ARMS):
        p.error(f"unknown arm(s) {sorted(unknown)}: choose from {ARMS}")
    corpus = load_corpus()
    train_text, val_text = torch.from_numpy(corpus.train), torch.from_numpy(corpus.validation)
    starts = np.linspace(0, len(val_text) - args.seq_len - 2, args.eval_windows).astype(np.int64)
    val = windows(val_text, starts, args.seq_len)
    ids = val[:2, :-1]  # an example batch of ids for graph_from_module and apply
    report_at = sorted({max(1, round(args.steps * (i + 1) / args.points)) for i in range(args.points)})
    t0, losses, solved = time.perf_counter(), {}, {}
    for lr in lrs:
        for arm in arms:
            t = time.perf_counter()
            model = make_arm(arm, args, ids, solved)
            losses[(lr, arm)] = train(model, train_text, val, lr, args, report_at)
            print(f"lr {lr:g}, {arm}: {time.perf_counter() - t:.1f} s", flush=True)
    wall = time.perf_counter() - t0
    cols = [0, *report_at]
    print(
        f"\nGPT-2 {args.layers} blocks, width {args.width}, {args.heads} heads, T {args.seq_len}, batch {args.batch}, "
        f"{args.method} gelu_tanh {args.shaping}; validation nats/byte on {args.eval_windows} windows, "
        f"corpus {corpus.digest[:12]}"
    )
    print("| lr | arm | " + " | ".join(f"step {s}" for s in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for (lr, arm), row in losses.items():
        cells = [f"{row[s]:.3f}" if s in row else "diverged" for s in cols]
        print(f"| {lr:g} | {arm} | " + " | ".join(cells) + " |")
    print(f"wall time {wall:.0f} s, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    return {"losses": losses, "steps": cols, "wall_s": wall}


if __name__ == "__main__":
    main()
