"""Training a draft head on the CPU (`triforce train-drafter`).

    generate  the target continues prompts (data.py): shards of tokens and features under OUT/work/data
    train     the head learns, at every position, the target's next feature and next-token distribution:
              loss = smooth-L1(f^, f) + CLS_WEIGHT * cross-entropy(p, q) (EAGLE's), where p is the target's
              distribution (its LM head over f) and q the head's (the LM head over f^); with UNROLL 2 also the
              same loss one step later, fed its own predictions as features (as it drafts past the first token)
    evaluate  acceptance of its drafts against the target, on held-out text (the bench's genres)

Everything is seeded (--seed): the data by shard, the initial weights, the batch order. The state is
checkpointed atomically (OUT/work/checkpoint.pt) every CHECKPOINT_SECONDS and at the end of each epoch; a
run with the same arguments resumes from it after Ctrl-C or kill -9. The LM head's products run in bf16
(oneDNN on AVX512-BF16 or AMX: 4x fp32's speed), the head's own layer in fp32.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import TriforceError
from ..model import Transformer
from .data import (PromptSource, RANDOM_PROMPT_TOKENS, generate_shard, save_atomic, shard_kind,
                   shard_temperature)
from .head import DraftHead, HeadConfig, dense_weight, embed_tokens

CLS_WEIGHT = 0.1
METRIC_ROWS = 64  # rows of each step whose acceptance and top-1 agreement are logged
CHECKPOINT_SECONDS = 60.0


@dataclass(frozen=True)
class TrainSettings:
    tokens: int = 600_000  # generated tokens of training data (rounded up to whole shards)
    shard_prompts: int = 32  # prompts per shard (one batched generation)
    new_tokens: int = 192  # tokens the target writes per prompt
    epochs: int = 2
    batch: int = 8  # sequences per step
    lr: float = 1e-3
    unroll: int = 2  # steps of the head trained in sequence (1: EAGLE-1's teacher forcing only)
    window: int = 1024  # the head's attention window when it drafts
    seed: int = 0

    @property
    def shards(self) -> int:
        return math.ceil(self.tokens / (self.shard_prompts * self.new_tokens))

    @property
    def seq_len(self) -> int:
        """Tokens per training sequence: every shard's last seq_len (the shortest prompt plus the new tokens)."""
        return RANDOM_PROMPT_TOKENS + self.new_tokens


def dense_lm_head(model: Transformer) -> torch.Tensor:
    """The target's LM head as a dense bf16 matrix [V, hidden] (for the training products)."""
    return dense_weight(model.lm_head).to(torch.bfloat16)


def _logits(x: torch.Tensor, W: torch.Tensor, softcap: float | None) -> torch.Tensor:
    out = (x.to(torch.bfloat16) @ W.T).float()
    return out if softcap is None else torch.tanh(out / softcap) * softcap


class Trainer:
    def __init__(self, model: Transformer, tokenizer, out: Path, settings: TrainSettings, progress: bool = True,
                 command: str = ""):
        self.model, self.tokenizer, self.out, self.s, self.progress = model, tokenizer, Path(out), settings, progress
        self.work = self.out / "work"
        self.data_dir = self.work / "data"
        self.command = command

    # -- data ----------------------------------------------------------------------------------------------------
    def make_data(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        todo = [i for i in range(self.s.shards) if not (self.data_dir / f"shard-{i:05d}.pt").exists()]
        if not todo:
            return
        source = PromptSource(self.tokenizer)
        per_shard = self.s.shard_prompts * self.s.new_tokens
        with tqdm(total=self.s.shards * per_shard, initial=(self.s.shards - len(todo)) * per_shard,
                  desc="generating training text", unit="tok", disable=not self.progress, smoothing=0.1) as bar:
            for i in todo:
                rng = random.Random(f"{self.s.seed}-{i}")
                prompts = source.batch(shard_kind(i), self.s.shard_prompts, rng)
                gen = torch.Generator().manual_seed(rng.randrange(2 ** 62))
                shard = generate_shard(self.model, prompts, self.s.new_tokens, shard_temperature(i), gen)
                save_atomic(shard, self.data_dir / f"shard-{i:05d}.pt")
                bar.update(per_shard)

    def load_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """-> tokens [N, S] (int64), features [N, S, hidden] (bf16): every shard cut to its last seq_len tokens."""
        tokens, feats = [], []
        S = self.s.seq_len
        for i in range(self.s.shards):
            shard = torch.load(self.data_dir / f"shard-{i:05d}.pt")
            tokens.append(shard["tokens"][:, -S:].long())
            feats.append(shard["features"][:, -S:])
        return torch.cat(tokens), torch.cat(feats)

    # -- training ------------------------------------------------------------------------------------------------
    def new_head(self) -> DraftHead:
        torch.manual_seed(self.s.seed)
        head = DraftHead(HeadConfig.for_target(self.model, window=self.s.window), self.model.cfg)
        head.init_from(self.model)
        return head

    def loss(self, head: DraftHead, W: torch.Tensor, tokens: torch.Tensor, feats: torch.Tensor
             ) -> tuple[torch.Tensor, dict]:
        """tokens [B, S], feats [B, S, hidden] -> the loss and its parts (see the module docstring)."""
        cap = self.model.cfg.final_logit_softcap
        f = feats.float()
        positions = torch.arange(1, tokens.shape[1])
        emb = embed_tokens(self.model, tokens[:, 1:])
        target = f[:, 1:]  # f[i] for i = 1 .. S - 1
        with torch.no_grad():
            p = torch.softmax(_logits(target, W, cap), dim=-1)
        feature_in = f[:, :-1]
        total, parts = 0.0, {}
        for step in range(self.s.unroll):
            pred = head(feature_in, emb, positions)
            reg = F.smooth_l1_loss(pred[:, step:], target[:, step:])
            z = _logits(pred[:, step:], W, cap).flatten(0, 1)
            ps = p[:, step:].flatten(0, 1)
            cls = F.cross_entropy(z, ps)
            with torch.no_grad():  # on a few rows: sum(min(p, q)) is the acceptance at T = 1
                rows = slice(0, z.shape[0], max(1, z.shape[0] // METRIC_ROWS))
                q = torch.softmax(z[rows].detach(), dim=-1)
                parts[f"acc{step}"] = float(torch.minimum(ps[rows], q).sum(-1).mean())
                parts[f"top1_{step}"] = float((q.argmax(-1) == ps[rows].argmax(-1)).float().mean())
            total = total + reg + CLS_WEIGHT * cls
            parts[f"reg{step}"], parts[f"cls{step}"] = float(reg.detach()), float(cls.detach())
            # the next step reads this step's predictions as the features of the positions before
            feature_in = torch.cat([f[:, :1], pred[:, :-1]], dim=1)
        return total, parts

    def train(self) -> DraftHead:
        s = self.s
        tokens, feats = self.load_data()
        n = tokens.shape[0]
        steps_per_epoch = n // s.batch
        total_steps = steps_per_epoch * s.epochs
        head = self.new_head()
        opt = torch.optim.AdamW(head.parameters(), lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 50) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(k, total_steps) / total_steps))))
        step, history = 0, []
        ckpt = self.work / "checkpoint.pt"
        if ckpt.exists():
            state = torch.load(ckpt, weights_only=False)
            if state["settings"] != asdict(s):
                raise TriforceError(f"{ckpt} was made with other settings ({state['settings']}): use the same "
                                    f"arguments to resume, or another --out")
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step, history = state["step"], state["history"]
        W = dense_lm_head(self.model)
        head.train()
        last_save = time.monotonic()
        with tqdm(total=total_steps, initial=step, desc="training the draft head", unit="step",
                  disable=not self.progress) as bar:
            while step < total_steps:
                epoch, k = divmod(step, steps_per_epoch)
                order = torch.randperm(n, generator=torch.Generator().manual_seed(s.seed * 1000 + epoch))
                idx = order[k * s.batch:(k + 1) * s.batch]
                loss, parts = self.loss(head, W, tokens[idx], feats[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opt.step()
                sched.step()
                step += 1
                history.append({"step": step, "loss": round(float(loss.detach()), 5), **{k: round(v, 5) for k, v in parts.items()}})
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{parts['acc0']:.3f}",
                                **({"acc1": f"{parts['acc1']:.3f}"} if "acc1" in parts else {}))
                if step == total_steps or step % steps_per_epoch == 0 or time.monotonic() - last_save > CHECKPOINT_SECONDS:
                    save_atomic({"settings": asdict(s), "head": head.state_dict(), "opt": opt.state_dict(),
                                 "sched": sched.state_dict(), "step": step, "history": history}, ckpt)
                    last_save = time.monotonic()
        head.eval()
        self.history = history
        return head

    def run(self) -> DraftHead:
        t0 = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        self.make_data()
        t1 = time.monotonic()
        head = self.train()
        t2 = time.monotonic()
        last = self.history[-50:]
        head.cfg.trained = {
            "command": self.command, "settings": asdict(self.s), "threads": torch.get_num_threads(),
            "data_seconds": round(t1 - t0, 1), "train_seconds": round(t2 - t1, 1),
            "final": {k: round(sum(h[k] for h in last) / len(last), 4) for k in last[0] if k != "step"},
            "torch": torch.__version__,
        }
        head.save(self.out)
        return head


def check_trainable(model: Transformer) -> None:
    """A model the head design can train for: one KV cache layout, no sliding windows (TriforceError)."""
    if model.windows is not None:
        raise TriforceError(f"train-drafter does not support models with sliding-window layers yet (this "
                            f"{model.cfg.arch} model has them)")
    if model.device.type != "cpu":
        raise TriforceError("train-drafter trains on the CPU: use --device cpu")
