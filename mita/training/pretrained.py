"""Fine-tune a pretrained transformers model on your labelled file, with MiTA or dense
attention, and compare the ways: ``python -m mita.training --model DIR --train FILE --out OUT
[--compare]`` (docs/pretrained.md).

``DIR`` is a transformers model folder (``mita.pretrained.folder``), loaded offline. Text rows
are tokenized by the model's own tokenizer (cut to ``--max-len``, default the model's
positions); ids rows are the tokenizer's ids; image rows (pixel ids, ``mita.data.images``) go
to an image model. One run (``--mode dense`` or ``mita``) writes the fine-tuned model to
``OUT`` with ``save_pretrained`` (weights, ``config.json`` with ``id2label`` / ``label2id``
and the MiTA setting, the tokenizer) and ``training.json``. ``--compare`` runs the ways on the
same data, budget and seed — dense fine-tuned; drop-in (those weights switched to MiTA,
untrained); fine-tuned (dense fine-tuned, then ``--finetune-share`` × steps more with MiTA);
mita (MiTA fine-tuned from the pretrained weights) — each kept in ``OUT/ways/WAY``, the table
and plot in ``OUT/compare.{md,json,png}`` as for the product's own model.
"""

from __future__ import annotations

import json
import math
import platform
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ModelConfig, parse_setting, pretrained_model_config
from ..cost import activation_bytes_estimate
from ..data import labelled
from ..pretrained import PretrainedSetting, setting_of, use_attention
from ..pretrained.folder import folder_kind, load_classifier, logits, max_tokens
from ..tools.progress import Progress
from ..tools.scores import classification_scores, score_warnings
from .compare_report import add_retention, markdown, median_ms, way_row, write_compare
from .fit import LOG_INTERVAL_S, length_batches, one_cycle

DEFAULT_LR = 5e-5  # fine-tuning a pretrained encoder (BERT's recipe); --lr overrides


def encode(examples: list[labelled.Example], tokenizer, kind: str, limit: int,
           pixels: int | None = None) -> tuple[list[list[int]], int]:
    """Each example's model input and how many were cut: text through ``tokenizer`` (special
    tokens added, cut to ``limit`` tokens), ids rows cut to ``limit`` (checked against the
    vocabulary), image rows as they are (``pixels`` = image_size² pixel ids 1 … 256 each).
    Raises ValueError naming the file and line of an id outside the vocabulary, a text row
    for an image model, an image row of another size or with a value that is not a pixel."""
    out, cut = [], 0
    for ex in examples:
        where = f"{ex.path}:{ex.line}"
        if kind == "image":
            if ex.text is not None:
                raise ValueError(f"{where}: a text row for an image model")
            if len(ex.ids) != pixels:
                raise ValueError(f"{where}: an image row of {len(ex.ids)} pixels; the model "
                                 f"takes {math.isqrt(pixels)}×{math.isqrt(pixels)} images "
                                 f"({pixels} pixel ids)")
            if max(ex.ids) > 256:
                raise ValueError(f"{where}: pixel id {max(ex.ids)} is not a grey value + 1 "
                                 "(1 … 256)")
            out.append(list(ex.ids))
            continue
        if ex.text is not None:
            ids = tokenizer(ex.text, truncation=False)["input_ids"]
        else:
            ids = list(ex.ids)
            bad = [i for i in ids if not 0 <= i < len(tokenizer)]
            if bad:
                raise ValueError(f"{where}: id {bad[0]} is outside the model's vocabulary "
                                 f"(0 … {len(tokenizer) - 1})")
        if len(ids) > limit:
            cut += 1
            ids = (tokenizer(ex.text, truncation=True, max_length=limit)["input_ids"]
                   if ex.text is not None else ids[:limit])
        out.append(ids)
    return out, cut


def train(model, rows, labels, steps: int, batch_size: int, lr: float, seed: int,
          time_budget_min: float, pad_id) -> dict:
    """Fine-tune ``model`` in place: AdamW, one-cycle schedule (``fit.one_cycle``), gradient
    clipping at 1.0, length-bucketed batches (``fit.length_batches``), cross-entropy on the
    head's logits. Stops after ``steps`` or ``time_budget_min``; returns steps, wall seconds,
    the last loss and whether the time budget stopped it."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    sched = one_cycle(opt, lr, steps)
    model.train()
    t0, step, loss, budget_stop = time.perf_counter(), 0, float("nan"), False
    # a bar on a terminal, a line every LOG_INTERVAL_S in a log: minutes pass on a CPU
    attention = "dense" if model.config._attn_implementation == "mita_dense" else "mita"
    bar = Progress(steps, f"fine-tune[{attention}]", "step", interval_s=LOG_INTERVAL_S)
    while step < steps and not budget_stop:
        for batch in length_batches([len(r) for r in rows], batch_size, rng):
            y = torch.tensor([labels[i] for i in batch], device=model.device)
            out = logits(model, [rows[i] for i in batch], pad_id)
            loss_t = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss_t.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step, loss = step + 1, loss_t.item()
            bar.update()
            bar.phase(f"loss {loss:.3f}")
            if not math.isfinite(loss):
                raise ValueError(f"the training loss is {loss} at step {step} (lr {lr:g}): "
                                 "lower --lr")
            if step >= steps:
                break
            if time.perf_counter() - t0 > 60 * time_budget_min:
                budget_stop = True
                break
    bar.close()
    model.eval()
    return {"steps": step, "wall_s": round(time.perf_counter() - t0, 1), "last_loss": loss,
            "stopped_by_time_budget": budget_stop}


@torch.no_grad()
def predict(model, rows, pad_id, batch_size: int = 32) -> list[int]:
    """Predicted class index of each row, in order (eval mode, batches of similar length)."""
    model.eval()
    pred = [0] * len(rows)
    for batch in length_batches([len(r) for r in rows], batch_size, random.Random(0)):
        out = logits(model, [rows[i] for i in batch], pad_id).argmax(-1).tolist()
        for i, p in zip(batch, out, strict=True):
            pred[i] = p
    return pred


@torch.no_grad()
def forward_ms(model, n: int, pad_id, seed: int = 0) -> float:
    """Median wall time (ms) of ``TIMING_REPEATS`` batch-1 forwards of ``n`` random tokens
    (image models: one image), after one warm-up."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    row = (torch.randint(1, 257, (c.image_size ** 2,), generator=g) if hasattr(c, "image_size")
           else torch.randint(1000 if c.vocab_size > 2000 else 1, c.vocab_size, (n,),
                              generator=g)).tolist()
    return median_ms(lambda: logits(model, [row], pad_id))


# The product's own encoder's flags: they mean nothing for a pretrained model and are refused
# when given with --model rather than silently ignored.
OWN_ENCODER_FLAGS = ("--dim", "--depth", "--num-heads", "--ffn-dim", "--num-landmarks",
                     "--topk", "--route-topk", "--class-weight", "--truncate", "--task-name",
                     "--eval-every")


def _setting(args, kind: str, config) -> PretrainedSetting | None:
    """The setting of ``--setting``, ``--landmark-grid`` and ``--shared-scale`` (None: the
    folder's own, else ``default_setting``). Images keep their patch grid unless
    ``--landmark-grid`` says otherwise. Raises ValueError: a grid for a text model, a grid of
    more cells than the model has patches."""
    from ..pretrained.folder import default_setting

    if args.setting is None and args.landmark_grid is None and args.shared_scale == "paper":
        return None
    if kind == "text" and args.landmark_grid is not None:
        raise ValueError("--landmark-grid is for image models (a text model pools in 1-D)")
    base = default_setting(config, kind)
    grid = args.landmark_grid or base.landmark_grid
    if grid is not None and kind == "image":
        side = config.image_size // config.patch_size
        if grid[0] * grid[1] > side * side:
            raise ValueError(f"--landmark-grid {grid[0]}x{grid[1]} has more cells than the "
                             f"model's {side}×{side} patches")
    m, k, s = parse_setting(args.setting) if args.setting else (
        base.num_landmarks, base.topk, base.route_topk)
    return PretrainedSetting(num_landmarks=m, topk=k, route_topk=s,
                             shared_scale=args.shared_scale, landmark_grid=grid)


def main(p, args, argv) -> dict:
    """``python -m mita.training --model DIR --train FILE …`` (``p``: the parser, for its
    errors: a bad folder, data, setting or head/label mismatch is a usage error naming it)."""
    import sys

    given = [a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])]
    for flag in ("resume", "init", "subword_vocab", "vocab_size", "keep_ways"):
        if getattr(args, flag) not in (None, False):
            p.error(f"--{flag.replace('_', '-')} is not for --model (a pretrained model "
                    "brings its own tokenizer and weights)")
    for flag in OWN_ENCODER_FLAGS:
        if flag in given:
            p.error(f"{flag} is for the product's own encoder, not for --model (its MiTA "
                    "setting: --setting MxK[xS], --landmark-grid, --shared-scale)")
    if "--mode" in given and args.mode == "mixed":
        p.error("--mode mixed trains the product's own encoder with both attentions; with "
                "--model: --mode dense or mita, or --compare")
    if args.finetune_share is not None and not args.compare:
        p.error("--finetune-share is the fine-tuned way's share of --compare")
    if args.valid is not None and args.valid_share is not None:
        p.error("--valid and --valid-share: give one (a validation file, or a share of "
                "--train)")
    if args.mode == "mixed":
        args.mode = "dense" if args.compare else "mita"
    lr = args.lr if args.lr is not None else DEFAULT_LR
    try:
        kind = folder_kind(args.model)
        from transformers import AutoConfig

        setting = _setting(args, kind, AutoConfig.from_pretrained(args.model,
                                                                  local_files_only=True))
        train_file = labelled.read_file(args.train)
        valid_file = labelled.read_file(args.valid, like=train_file) if args.valid else None
        if valid_file is None:
            train_ex, valid_ex = labelled.split(train_file.examples, args.valid_share or 0.1,
                                                args.seed)
        else:
            train_ex, valid_ex = train_file.examples, valid_file.examples
        names = labelled.label_order({ex.label for ex in train_ex})
        if len(names) < 2:
            raise ValueError(f"{args.train}: one class only ({names[0]!r}): there is nothing "
                             "to classify")
        for ex in valid_ex:
            if ex.label not in names:
                raise labelled.unknown_label(ex, names, str(args.train))
        base, tokenizer = load_classifier(args.model, "dense", names, setting, seed=args.seed)
        names = [base.config.id2label[i] for i in range(base.config.num_labels)]
        most = max_tokens(base)
        if args.max_len is not None and args.max_len > most:
            raise ValueError(f"--max-len {args.max_len}: the model's positions allow {most} "
                             "tokens")
        limit = args.max_len or most
        pixels = base.config.image_size ** 2 if kind == "image" else None
        index = {n: i for i, n in enumerate(names)}
        (rows, cut), (val_rows, val_cut) = (encode(e, tokenizer, kind, limit, pixels)
                                            for e in (train_ex, valid_ex))
        y, y_val = ([index[ex.label] for ex in e] for e in (train_ex, valid_ex))
        args.out.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        p.error(str(e))
    if cut or val_cut:
        print(f"cut to {limit} tokens (the tokenizer's truncation: the end dropped): "
              f"{cut} of {len(rows)} training rows, {val_cut} of {len(val_rows)} validation "
              "rows")
    pad_id = None if tokenizer is None else tokenizer.pad_token_id
    budget = dict(steps=args.steps, batch_size=args.batch_size, lr=lr, seed=args.seed,
                  time_budget_min=args.time_budget_min, pad_id=pad_id)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, base, tokenizer, names, rows, y, val_rows, y_val, budget,
                    {"limit": limit, "cut_train_rows": cut, "cut_valid_rows": val_cut})
    except ValueError as e:  # a loss that is not finite
        p.error(str(e))


def _run(args, argv, base, tokenizer, names, rows, y, val_rows, y_val, budget, cuts) -> dict:
    pad_id, lr = budget["pad_id"], budget["lr"]
    if not args.compare:
        use_attention(base, args.mode)
        run = train(base, rows, y, **budget)
        pred = predict(base, val_rows, pad_id)
        sc = classification_scores(y_val, pred, names)
        lengths = sorted(len(r) for r in rows)
        record = {"model": str(args.model), "mode": args.mode, **run, "lr": lr,
                  "train_tokens": {"p50": lengths[len(lengths) // 2], "max": lengths[-1],
                                   **cuts},
                  "seed": args.seed, "batch_size": args.batch_size, "valid": sc,
                  "warnings": score_warnings(sc), "command": _command(argv)}
        _save(base, tokenizer, args.out, record)
        print(json.dumps({k: record[k] for k in ("mode", "steps", "wall_s")}
                         | {"valid_accuracy": sc["accuracy"]}))
        return record
    return compare(args, base, tokenizer, names, rows, y, val_rows, y_val, budget, argv)


def compare(args, dense, tokenizer, names, rows, y, val_rows, y_val, budget, argv) -> dict:
    """The four ways (module docstring) on one budget; rows as ``train_data.compare``'s, so
    ``markdown`` and ``write_compare`` draw them."""
    fine_steps = max(1, round((args.finetune_share or 0.25) * args.steps))
    pad_id = budget["pad_id"]
    runs = {"dense": train(dense, rows, y, **budget)}
    drop_in = dense  # the same weights, switched: saved and scored before fine-tuning on
    setting = setting_of(dense.config)  # every way: the setting the dense model was given
    fine, _ = load_classifier(args.model, "mita", names, setting, seed=args.seed)
    fine.load_state_dict(dense.state_dict())
    use_attention(fine, "mita")
    runs["fine-tuned"] = train(fine, rows, y, **(budget | {"steps": fine_steps}))
    runs["fine-tuned"]["steps"] += runs["dense"]["steps"]
    mita, _ = load_classifier(args.model, "mita", names, setting, seed=args.seed)
    runs["mita"] = train(mita, rows, y, **budget)
    lengths = sorted(len(r) for r in val_rows)
    n50, n99 = lengths[len(lengths) // 2], lengths[min(len(lengths) - 1,
                                                      int(0.99 * len(lengths)))]
    out_rows, ref = [], None
    for way, model, attention in (("dense", dense, "dense"), ("drop-in", drop_in, "mita"),
                                  ("fine-tuned", fine, "mita"), ("mita", mita, "mita")):
        use_attention(model, attention)
        pred = predict(model, val_rows, pad_id)
        ref = pred if ref is None else ref
        sc = classification_scores(y_val, pred, names)
        folder = args.out / "ways" / way
        run = runs.get(way, runs["dense"])
        _save(model, tokenizer, folder, {"way": way, "attention": attention, **run,
                                         "valid": sc, "command": _command(argv)})
        ms = (forward_ms(model, n50, pad_id), forward_ms(model, n99, pad_id))
        # an image model sees its patches and prefix tokens, not the pixel ids
        tokens = max_tokens(model) if hasattr(model.config, "image_size") else n99
        memory = activation_bytes_estimate(ModelConfig.from_dict(pretrained_model_config(
            model.config.to_dict(), setting.to_dict(), attention)), 1, tokens)
        out_rows.append(way_row(way, attention, run["steps"], sc, pred, ref, ms,
                                run["stopped_by_time_budget"], folder, memory))
    add_retention(out_rows)
    sc = classification_scores(y_val, ref, names)
    report = {"model": str(args.model), "setting": setting.to_dict(), "rows": out_rows,
              "lengths": {"p50": n50, "p99": n99},
              "budget": {"steps": args.steps, "time_budget_min": args.time_budget_min,
                         "finetune_steps": fine_steps, "batch_size": args.batch_size,
                         "seed": args.seed, "lr": budget["lr"]},
              "valid_rows": len(val_rows), "labels": names,
              "majority_label": sc["majority_label"], "majority_rate": sc["majority_rate"],
              "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                         f"torch {torch.__version__}, CPU", "command": _command(argv)}
    write_compare(report, args.out)
    print(markdown(report))
    return report


def _save(model, tokenizer, folder: Path, record: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / "training.json").write_text(json.dumps(record, indent=2) + "\n")


def _command(argv) -> str:
    import sys

    return "python -m mita.training " + " ".join(argv if argv is not None else sys.argv[1:])
