"""`freesolo train`: a small LLaMA-style model on the retrieval mixture, within a time budget.

Loss: next-token cross-entropy, `lm_weight` x the mean over ordinary tokens plus the mean over
answer tokens (the retrieval signal is a few tokens per sequence: weighting it keeps it from
drowning in the haystack). AdamW, linear warm-up, cosine decay to 10 % over the time budget (or
`--steps`), bf16 autocast on CUDA, gradient clipping at 1.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time

from .data import ROW_KINDS, Mixture, batches, lengths_up_to
from .modelio import (
    backend_scope,
    build_model,
    count_params,
    load_model,
    pick_backend,
    pick_device,
    retarget,
    save_model,
)
from .taskfile import read_task_json, task_json, write_task_json
from .tasks import TASKS
from .vocab import VOCAB

__all__ = ["add_train_parser", "answer_accuracy", "cmd_train", "loss_fn"]


def loss_fn(logits, tokens, answer_mask, lm_weight: float, acc_mask=None):
    """Weighted next-token loss. logits [B, T, V], tokens int64 [B, T], answer_mask bool [B, T].

    Returns (loss, accuracy over the answer tokens that `acc_mask` bool [B, T] also marks (default:
    all answer tokens), nan when there are none)."""
    import torch
    import torch.nn.functional as F

    V = logits.shape[-1]
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), tokens[:, 1:].reshape(-1), reduction="none")
    ce = ce.view(tokens.shape[0], -1)  # (B, T-1): loss of predicting token t+1
    ans = answer_mask[:, 1:]
    n_ans = ans.sum()
    lm_part = (ce * ~ans).sum() / (~ans).sum().clamp(min=1)
    loss = lm_weight * lm_part
    if n_ans > 0:
        loss = loss + (ce * ans).sum() / n_ans
    return loss, answer_accuracy(logits, tokens, answer_mask if acc_mask is None else answer_mask & acc_mask)


def answer_accuracy(logits, tokens, mask):
    """Argmax accuracy of next-token predictions on the tokens `mask` bool [B, T] marks (a target
    at t is predicted at t - 1); nan when it marks none. logits [B, T, V], tokens int64 [B, T]."""
    import torch

    scored = mask[:, 1:]
    n_scored = scored.sum()
    if n_scored == 0:
        return torch.tensor(float("nan"))
    pred = logits[:, :-1].argmax(-1)
    return ((pred == tokens[:, 1:]) & scored).sum().float() / n_scored


def _prefetch(gen, depth: int):
    """Run a batch generator in a background thread (data generation overlaps the GPU step)."""
    q: queue.Queue = queue.Queue(maxsize=depth)

    def work():
        for item in gen:
            q.put(item)

    threading.Thread(target=work, daemon=True).start()
    while True:
        yield q.get()


def _fs_kwargs(args) -> dict:
    return {
        "window": args.window,
        "cell": args.cell,
        "block": args.block,
        "top_k": args.top_k,
        "pool": args.pool,
        "recent": args.recent,
    }


def cmd_train(args) -> int:
    import torch
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    backend = pick_backend(args.backend, device)
    if args.init_from:
        info = read_task_json(args.init_from)
        model = load_model(args.init_from)
        if args.attention != model.config.attention:
            model = retarget(model, args.attention)
        init_note = {"init_from": os.path.abspath(args.init_from), "init_train_length": info["train_length"]}
    else:
        model = build_model(
            args.attention, VOCAB.vocab_size, args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, _fs_kwargs(args)
        )
        init_note = {}
    model = model.to(device).float()
    model.train()
    tasks = tuple(args.tasks) if args.tasks else tuple(TASKS)
    mix = Mixture(
        tasks=tasks,
        lm_fraction=args.lm_fraction,
        lengths=lengths_up_to(args.train_length, args.n_lengths),
        batch_tokens=args.batch_tokens,
        copy_fraction=args.copy_fraction,
        recall_fraction=args.recall_fraction,
    )
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or "beta" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    budget = args.minutes * 60.0
    n_params = count_params(model)
    print(
        f"freesolo train: attention={args.attention} backend={backend} device={device} params={n_params / 1e6:.2f}M "
        f"train_length={args.train_length} lengths={list(mix.lengths)} batch_tokens={mix.batch_tokens} "
        f"budget={args.minutes} min" + (f" steps<={args.steps}" if args.steps else "")
    )
    stream = batches(mix, args.seed, return_kinds=True)
    if args.prefetch > 0:
        stream = _prefetch(stream, args.prefetch)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    log, step, tokens_seen = [], 0, 0
    bar = tqdm(total=args.steps or None, desc=f"train {args.attention}", unit="step", disable=args.quiet)
    start = time.perf_counter()
    ema_loss, ema_acc, last_print = None, None, 0.0
    with backend_scope(backend):
        while True:
            elapsed = time.perf_counter() - start
            progress = elapsed / budget if budget > 0 else 0.0
            if args.steps:
                progress = max(progress, step / args.steps)
            if progress >= 1.0:
                break
            warm = min(1.0, (step + 1) / args.warmup)
            lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
            for g in opt.param_groups:
                g["lr"] = lr
            tok_np, mask_np, kinds_np = next(stream)
            tok = torch.from_numpy(tok_np).to(device, non_blocking=True)
            mask = torch.from_numpy(mask_np).to(device, non_blocking=True)
            task_rows = torch.from_numpy(kinds_np == ROW_KINDS["task"]).to(device, non_blocking=True)
            recall_rows = torch.from_numpy(kinds_np == ROW_KINDS["recall"]).to(device, non_blocking=True)
            copy_rows = torch.from_numpy(kinds_np == ROW_KINDS["copy"]).to(device, non_blocking=True)
            with autocast:
                logits = model(tok)
            # the logged accuracy is the tasks' (the drills' targets are easier and would hide it)
            loss, acc = loss_fn(logits, tok, mask, args.lm_weight, acc_mask=task_rows[:, None].expand_as(mask))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += tok.numel()
            if step % args.log_every == 0 or step == 1:
                lv, av = float(loss.detach()), float(acc)
                # the recall drill's accuracy: the first sign that the key-conditioned lookup formed
                rv = float(answer_accuracy(logits.detach(), tok, mask & recall_rows[:, None]))
                # the copy drill's accuracy: the induction circuit (content match, then copy) formed
                cv = float(answer_accuracy(logits.detach(), tok, mask & copy_rows[:, None]))
                ema_loss = lv if ema_loss is None else 0.9 * ema_loss + 0.1 * lv
                if not math.isnan(av):
                    ema_acc = av if ema_acc is None else 0.9 * ema_acc + 0.1 * av
                if not math.isfinite(lv):
                    raise FloatingPointError(f"loss is {lv} at step {step}")
                el = time.perf_counter() - start
                log.append({"step": step, "seconds": round(el, 2), "loss": lv, "answer_acc": av, "recall_acc": rv, "copy_acc": cv, "lr": lr, "tokens": tokens_seen})
                bar.set_postfix(loss=f"{ema_loss:.3f}", ans_acc=f"{(ema_acc or 0):.3f}", tok_s=f"{tokens_seen / el:,.0f}")
                if args.quiet and el - last_print >= 30:  # no bar: a plain line every 30 s
                    last_print = el
                    print(f"  step {step}  {el:.0f} s  loss {ema_loss:.3f}  task answer-token acc {(ema_acc or 0):.3f}  recall drill acc {rv:.3f}  copy drill acc {cv:.3f}  {tokens_seen / el:,.0f} tok/s", flush=True)
            bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start
    out = args.out
    os.makedirs(out, exist_ok=True)
    model.eval()
    size = save_model(model.cpu(), out, args.save_dtype)
    extra = {
        "train": {
            "attention": args.attention,
            "backend": backend,
            "device": str(device),
            "steps": step,
            "tokens": tokens_seen,
            "seconds": round(elapsed, 1),
            "params": n_params,
            "lr": args.lr,
            "lm_weight": args.lm_weight,
            "seed": args.seed,
            "torch": torch.__version__,
            **init_note,
        }
    }
    write_task_json(out, task_json(args.train_length, mix.to_json(), extra=extra))
    with open(os.path.join(out, "train_log.json"), "w") as f:
        json.dump(log, f)
    print(
        f"saved {out} ({size / 2**20:.1f} MiB, {args.save_dtype}): {step} steps, {tokens_seen:,} tokens in {elapsed:.1f} s "
        f"({tokens_seen / max(elapsed, 1e-9):,.0f} tok/s), last loss {log[-1]['loss'] if log else float('nan'):.4f}"
    )
    return 0


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train a small LM on the retrieval mixture (time budget, checkpoints)")
    p.add_argument("--out", required=True, help="checkpoint folder (save_pretrained + task.json + train_log.json)")
    p.add_argument("--attention", choices=["dense", "window", "fs", "fsl"], default="fs")
    p.add_argument("--init-from", default=None, help="continue from a checkpoint (e.g. FS -> FS-L with --attention fsl)")
    p.add_argument("--train-length", type=int, default=1024, help="longest training sequence (<= 2048 in the recipe)")
    p.add_argument("--n-lengths", type=int, default=3, help="train at train_length / 2^k for k < n")
    p.add_argument("--minutes", type=float, default=3.0, help="time budget of the training loop")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: time budget only)")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--lm-weight", type=float, default=0.1, help="weight of the non-answer tokens' loss")
    p.add_argument("--lm-fraction", type=float, default=0.1, help="fraction of rows that are plain filler text")
    p.add_argument("--copy-fraction", type=float, default=0.15, help="fraction of rows that are copy drills")
    p.add_argument("--recall-fraction", type=float, default=0.35, help="fraction of rows that are many-key recall drills")
    p.add_argument("--tasks", nargs="*", default=None, help=f"tasks of the mixture (default all: {list(TASKS)})")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layers", type=int, default=6)
    p.add_argument("--n-heads", type=int, default=6)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--window", type=int, default=128, help="FreeSolo / window attention: local window")
    p.add_argument("--cell", type=int, default=16)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--recent", type=int, default=4)
    p.add_argument("--backend", default="auto", help="freesolo backend (auto: triton on CUDA when available, else torch)")
    p.add_argument("--device", default="auto")
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch", type=int, default=4, help="batches generated ahead in a thread (0: inline)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_train)


