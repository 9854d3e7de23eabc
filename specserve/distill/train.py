"""Training loops for the two draft kinds, with checkpoint/resume.

Loss at every position of a sampled continuation (the distributions the target drew its output from):

- soft cross-entropy against the target's top-K next-token distribution (renormalised over those K), i.e.
  KL(p_target || q_draft) up to the target's entropy;
- EAGLE head only: a feature-regression term, SmoothL1(ĥ_p, h_p) on features scaled by their RMS (EAGLE's
  regression loss), and a second, *unrolled* draft step ("training-time test"): the head is fed its own
  prediction ĥ_{p-1} as it is when drafting token 2..k, so it learns to recover from its own errors.

The head is initialised from the target's last decoder layer, its two input norms at the features' RMS and
fc = [I ; I] (embedding and feature both enter at the residual stream's scale: with the raw, unnormalised
embedding a head for SmolLM2 barely saw the token, 0.22 top-1 held out); a standalone draft from the
target's first L layers. Embedding, final norm and LM head stay frozen (they are the target's).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.distill import dense
from specserve.distill.data import Sample
from specserve.model.decoder import DecoderModel
from specserve.model.eagle_head import EagleConfig, EagleHead


@dataclass
class TrainConfig:
    steps: int  # total optimizer steps (across resumes)
    lr: float = 3e-3
    batch_tokens: int = 1024  # padded tokens per batch
    seed: int = 0
    reg_weight: float = 1.0
    unroll_weight: float = 1.0  # head: weight of the second (unrolled) draft step; 0 disables it
    save_every: int = 50
    warmup: int = 20
    # The step the LR schedule (warmup + cosine to ``steps``) starts from: 0, or where a finished run was
    # extended with more steps (a warm restart: its schedule had already decayed).
    schedule_from: int = 0
    loss_top_k: int = 16  # soft targets: the target's top-K (of the K collected)
    num_frequent: int = 2048  # always-present negatives of the sampled softmax
    vocab: torch.Tensor | None = None  # softmax over these ids (a head's draft vocabulary) instead
    # Mixed precision: matmuls under autocast in this dtype, fp32 master weights and optimizer state. On a CPU
    # with bf16 hardware (AVX512-BF16) a [1024 x 576] x [576 x 16384] matmul runs 3.7x faster in bf16.
    autocast: torch.dtype | None = None


@dataclass
class Batch:
    ids: torch.Tensor  # [B, S] int64 (padded with 0)
    features: torch.Tensor  # [B, S, hidden] float32: h_p (zeros where none)
    rows: torch.Tensor  # [N] batch row of each loss position
    pos: torch.Tensor  # [N] position p (predicts t_{p+1})
    vocab: torch.Tensor  # [M] token ids the batch's softmax runs over (sampled softmax)
    top_ids: torch.Tensor  # [N, K] indices into ``vocab`` of the target's top-K tokens
    top_p: torch.Tensor  # [N, K] target probabilities renormalised over the top K


def make_batches(samples: list[Sample], batch_tokens: int) -> list[list[int]]:
    """Length-sorted groups of sample indices with at most ``batch_tokens`` padded tokens each."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].token_ids))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = len(samples[i].token_ids)
        if cur and (len(cur) + 1) * n > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def frequent_tokens(samples: list[Sample], n: int) -> torch.Tensor:
    """The n tokens most often the target's top-1 choice in the data."""
    counts = torch.bincount(torch.cat([s.top_ids[:, 0] for s in samples]).long())
    return counts.argsort(descending=True)[:n][counts.sort(descending=True).values[:n] > 0]


def collate(samples: list[Sample], idx: list[int], device: torch.device, top_k: int,
            frequent: torch.Tensor, vocab: torch.Tensor | None = None) -> Batch:
    """Pad a group of samples. The softmax runs over ``vocab`` (the draft vocabulary: exactly what is served)
    or, without one, over the batch's top-K tokens plus the frequent ones (a sampled softmax: the LM head is
    49k x hidden for the demo model and dominates training on a CPU). With ``vocab``, target tokens outside it
    are dropped and the rest renormalised; positions with none left are skipped."""
    group = [samples[i] for i in idx]
    s_max = max(len(s.token_ids) for s in group)
    hidden = group[0].features.shape[-1]
    ids = torch.zeros(len(group), s_max, dtype=torch.long)
    feats = torch.zeros(len(group), s_max, hidden)
    rows, pos, top_ids, top_lp = [], [], [], []
    for b, s in enumerate(group):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(s.token_ids)
        feats[b, :n - 1] = s.features.float()
        p = torch.arange(s.first_target, n - 1)
        rows.append(torch.full_like(p, b))
        pos.append(p)
        top_ids.append(s.top_ids[:, :top_k])
        top_lp.append(s.top_logp[:, :top_k].float())
    tops, lp = torch.cat(top_ids).long(), torch.cat(top_lp)
    row, where = torch.cat(rows), torch.cat(pos)
    if vocab is None:
        vocab, inverse = torch.unique(torch.cat([tops.reshape(-1), frequent.long()]), return_inverse=True)
        local = inverse[:tops.numel()].view_as(tops)
    else:
        lookup = torch.full((int(max(int(vocab.max()), int(tops.max()))) + 1,), -1, dtype=torch.long)
        lookup[vocab] = torch.arange(vocab.numel())
        local = lookup[tops]
        lp = lp.masked_fill(local < 0, float("-inf"))
        keep = (local >= 0).any(-1)
        local, lp, row, where = local[keep].clamp(min=0), lp[keep], row[keep], where[keep]
    return Batch(ids.to(device), feats.to(device), row.to(device), where.to(device),
                 vocab.to(device), local.to(device), torch.softmax(lp, dim=-1).to(device))


def soft_ce(model: DecoderModel, features: torch.Tensor, b: Batch, rows: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(soft cross-entropy vs the target's top-K, top-1 agreement) of pre-norm features [N, H] through
    ``model``'s final norm and LM head restricted to ``b.vocab``; ``rows`` selects a subset of the targets."""
    normed = model.norm(features)
    logits = F.linear(normed, model.lm_head[b.vocab].to(normed.dtype)).float()  # [N, M]
    top_ids, top_p = (b.top_ids, b.top_p) if rows is None else (b.top_ids[rows], b.top_p[rows])
    logq = torch.log_softmax(logits, dim=-1)
    loss = -(top_p * logq.gather(-1, top_ids)).sum(-1).mean()
    agree = (logits.argmax(-1) == top_ids[:, 0]).float().mean()
    return loss, agree


def narrowed_mlp(layer: dict[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """A decoder layer's state dict with its (fused gate_up, down) MLP cut to the ``width`` channels with
    the largest |gate| * |up| * |down| norms; unchanged where the MLP is not wider than ``width``."""
    gate_up, down = layer.get("mlp.gate_up"), layer.get("mlp.down")
    if gate_up is None or down is None or down.dim() != 2 or down.shape[1] <= width:
        return layer
    inter = down.shape[1]
    gate, up = gate_up.float()[:inter], gate_up.float()[inter:]
    score = gate.norm(dim=1) * up.norm(dim=1) * down.float().norm(dim=0)
    keep = score.topk(width).indices.sort().values
    return {**layer, "mlp.gate_up": torch.cat([gate[keep], up[keep]]).to(gate_up.dtype),
            "mlp.down": down[:, keep].contiguous()}


class HeadTask:
    """EAGLE head over the frozen target (embedding, final norm, LM head)."""

    kind = "head"

    def __init__(self, target: DecoderModel, cfg: TrainConfig, feature_rms: float, name: str = "",
                 feature_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None) -> None:
        self.target, self.cfg, self.scale = target, cfg, feature_rms
        self.head = EagleHead(EagleConfig.from_target(target.arch, name, feature_layers, intermediate_size),
                              torch.float32, target.device, None, target.arch.max_position_embeddings + 64)
        h = target.arch.hidden_size
        with torch.no_grad():
            # The head's layer is a Llama layer: it starts as the target's last layer where the two share a
            # parameter (the whole layer for a Llama target; attention for Gemma or an MoE target, whose other
            # parts have no counterpart and start small and random). A narrower MLP starts as the last layer's
            # MLP cut to its strongest channels.
            own, last = self.head.layer.state_dict(), narrowed_mlp(target.layers[-1].state_dict(),
                                                                  self.head.cfg.intermediate_size)
            for name, p in own.items():
                if name in last and last[name].shape == p.shape:
                    p.copy_(last[name])
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)
            self.head.fc.zero_()
            self.head.fc[:, :h] = torch.eye(h)  # the embedding
            self.head.fc[:, -h:] = torch.eye(h)  # the last layer's feature; other layers start at zero
            for norm in (self.head.embed_norm, self.head.feature_norm):
                assert norm is not None
                norm.weight.fill_(feature_rms)  # the inputs enter at the residual stream's scale
        for p in self.head.parameters():
            p.requires_grad_(True)

    def module(self) -> torch.nn.Module:
        return self.head

    def loss(self, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        embeds = self.target.embed_tokens(b.ids).float()  # [B, S, H], frozen
        inputs = dense.shift_features(b.features)
        pred = dense.head_forward(self.head, embeds, inputs)  # [B, S, H]
        p1 = pred[b.rows, b.pos]  # [N, H]
        ce1, agree1 = soft_ce(self.target, p1, b)
        h = p1.shape[-1]  # the regression target is the last layer's feature (the last slot)
        reg = F.smooth_l1_loss(p1 / self.scale, b.features[b.rows, b.pos, -h:] / self.scale)
        loss = ce1 + self.cfg.reg_weight * reg
        stats = {"ce": ce1.item(), "reg": reg.item(), "top1": agree1.item()}
        if self.cfg.unroll_weight > 0:
            keep = (b.pos >= 1).nonzero().squeeze(1)
            p2 = dense.head_second_step(self.head, embeds, inputs, pred, b.rows[keep], b.pos[keep])
            ce2, agree2 = soft_ce(self.target, p2, b, keep)
            loss = loss + self.cfg.unroll_weight * ce2
            stats |= {"ce2": ce2.item(), "top1_2": agree2.item()}
        return loss, stats


class DraftModelTask:
    """A standalone L-layer draft: the target's first L layers (trained), its embedding/norm/LM head."""

    kind = "model"

    def __init__(self, target: DecoderModel, num_layers: int) -> None:
        self.target = target
        self.model = DecoderModel(target.arch.with_layers(num_layers), torch.float32, target.device, target.backend,
                                target.arch.max_position_embeddings + 64)
        with torch.no_grad():
            self.model.embed.copy_(target.embedding_table())
            if not target.arch.tie_word_embeddings:
                self.model.lm_head.copy_(target.lm_head)
            self.model.norm.load_state_dict(target.norm.state_dict())
            for i, layer in enumerate(self.model.layers):
                layer.load_state_dict(target.layers[i].state_dict())
        for p in [*self.model.layers.parameters(), *self.model.norm.parameters()]:
            p.requires_grad_(True)

    def module(self) -> torch.nn.Module:
        return self.model

    def loss(self, b: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        feats = dense.model_features(self.model, b.ids)  # [B, S, H]
        ce, agree = soft_ce(self.model, feats[b.rows, b.pos], b)
        return ce, {"ce": ce.item(), "top1": agree.item()}


def _lr_at(step: int, cfg: TrainConfig) -> float:
    step -= cfg.schedule_from
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.schedule_from - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def _schedule(batches: list[list[int]], seed: int, start: int) -> Iterator[tuple[int, list[int]]]:
    """(step, batch) from ``start`` on; epoch e visits the batches in a seeded order (resumable)."""
    step = start
    while True:
        epoch, off = divmod(step, len(batches))
        order = list(range(len(batches)))
        random.Random(seed * 1000 + epoch).shuffle(order)
        for j in order[off:]:
            yield step, batches[j]
            step += 1


def train(task: HeadTask | DraftModelTask, samples: list[Sample], cfg: TrainConfig, ckpt_path: str,
          resume: bool) -> dict[str, Any]:
    """Run to ``cfg.steps`` optimizer steps (continuing from ``ckpt_path`` when resuming)."""
    module = task.module()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    history: list[dict[str, float]] = []
    start = 0
    if resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, weights_only=False)
        if ck["kind"] != task.kind:
            raise ValueError(f"{ckpt_path} is a checkpoint for --kind {ck['kind']}, not {task.kind}")
        module.load_state_dict(ck["module"])
        opt.load_state_dict(ck["optimizer"])
        start, history = ck["step"], ck["history"]
        before = ck.get("config", {})
        if start >= before.get("steps", start) and cfg.steps > start:  # extending a finished run
            cfg.schedule_from = start
        else:  # continuing an interrupted run: its schedule
            cfg.schedule_from = before.get("schedule_from", 0)
    batches = make_batches(samples, cfg.batch_tokens)
    device = next(iter(params)).device
    frequent = frequent_tokens(samples, cfg.num_frequent)

    def save(step: int) -> None:
        torch.save({"kind": task.kind, "step": step, "module": module.state_dict(), "optimizer": opt.state_dict(),
                    "history": history,
                    "config": {k: str(v) if k == "autocast" else v for k, v in cfg.__dict__.items() if k != "vocab"}},
                   ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    bar = tqdm(total=cfg.steps, initial=min(start, cfg.steps), desc=f"train ({task.kind})", unit="step")
    step = start
    for step, idx in _schedule(batches, cfg.seed, start):
        if step >= cfg.steps:
            break
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        batch = collate(samples, idx, device, cfg.loss_top_k, frequent, cfg.vocab)
        with torch.autocast(device.type, dtype=cfg.autocast or torch.float32, enabled=cfg.autocast is not None):
            loss, stats = task.loss(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        history.append({"step": step + 1, "loss": loss.item(), **stats, "lr": opt.param_groups[0]["lr"]})
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in history[-1].items() if k not in ("step", "lr")})
        if (step + 1) % cfg.save_every == 0:
            save(step + 1)
    bar.close()
    final = step  # the loop stops at the first step >= cfg.steps (or at once when resuming past it)
    save(final)
    return {"step": final, "history": history, "num_batches": len(batches)}
