#!/usr/bin/env python3
"""PyTorch baseline for `examples/train_gpt/main.rs`: the same byte-level GPT, data and AdamW.

What it mirrors (see examples/train_gpt/main.rs, examples/common/ and src/models/gpt.rs):
  * Model: token embedding (256 x D) + learned position embedding (seq x D), `layers`
    pre-norm blocks [LayerNorm(eps 1e-5) -> causal multi-head self-attention with separate
    q, k, v, output Linears (all with bias) -> residual; LayerNorm -> Linear(D, 4D) -> exact
    (erf) GELU -> Linear(4D, D) -> residual], final LayerNorm, Linear(D, 256) head with bias,
    mean next-token cross-entropy. No dropout, no weight tying.
  * Init: the same distributions as burn's defaults: embeddings N(0, 1); every Linear weight
    and bias U(-1/sqrt(fan_in), 1/sqrt(fan_in)); LayerNorm gamma 1, beta 0. (These are also
    PyTorch's own defaults for nn.Embedding / nn.Linear / nn.LayerNorm.) The draws differ:
    burn's RNG is not torch's, so the initial weights are not bit-identical.
  * Data: data/corpus.txt, bytes as tokens, first 90 % for training. Each step's global
    batch is `batch` random windows of seq+1 bytes, their starts drawn with the same
    SplitMix64 stream as examples/common/data.rs (`Rng::new(seed, step).below(...)`), so the
    batches are byte-for-byte the ones the Rust run sees. Rank r of W trains on rows
    r*B/W .. (r+1)*B/W of that global batch (`my_rows`).
  * Optimizer: AdamW on every parameter, beta (0.9, 0.999), eps 1e-5 (burn's default, not
    torch's 1e-8), decoupled weight decay 0.01; global gradient-norm clipping at 1
    (max_norm / (norm + 1e-6), as in sshsdp-optim); peak lr 4e-3 with linear warm-up over
    20 steps and cosine decay to 10 % at the last step (common/optim.rs learning_rate).
  * Shape defaults: width 128, 4 layers, 4 heads, context 128, global batch 16, 400 steps,
    f32 everywhere (`--dtype bf16`: bf16 compute on fp32 weights, as `train_gpt --compute
    bf16`), seed 0.
  * Logged loss: the global-batch loss (mean of the ranks' losses). The final loss printed is
    the mean of the last (up to) 20 steps' global losses, like the Rust summary's "mean of
    the last 20 steps".

Differences that could not be avoided:
  * train_gpt's *defaults* are Muon (hidden matrices) + AdamW and bf16 runtime parameters;
    this script is the AdamW / f32 configuration. Compare it with
        cargo run --release --example train_gpt -- --optim adamw --format f32 [--ranks 1|2]
  * Initial weights (other RNG), hence slightly different loss curves.
  * Attention uses F.scaled_dot_product_attention(is_causal=True) by default (PyTorch's
    normal path); `--attn manual` instead computes softmax(QK^T/sqrt(d) masked with -1e4) V
    explicitly, the way burn's MultiHeadAttention does (src/models/attention.rs adds the same
    -1e4 as a bias instead: bit-identical results). The math is the same.
  * Throughput here excludes `--warmup` steps; the Rust summary's tokens/s averages all steps.
    Both count global tokens (batch * seq) per step.

Install (only PyPI is reachable here, so the CPU-only wheel index is not an option):
    python3 -m venv /tmp/torchenv
    /tmp/torchenv/bin/pip install torch numpy   # numpy only silences a warning
  PyPI's Linux x86_64 `torch` is the CUDA build: the torch wheel itself is ~540 MB and it
  pulls ~2.5 GB of nvidia-*/triton wheels that a CPU run never loads (5.3 GB installed).
  Where https://download.pytorch.org/whl/cpu is reachable,
    /tmp/torchenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  gets the CPU-only wheel (~180 MB) instead. Verified with torch 2.15.0.

Run (from the repository root):
    /tmp/torchenv/bin/python benches/pytorch_gpt.py --mode single --threads 2
    /tmp/torchenv/bin/python benches/pytorch_gpt.py --mode fsdp2 --world 2 --threads 1
  fsdp2 spawns --world processes itself (gloo on CPU, FSDP2 `fully_shard` on every block and
  on the root). It can also be started by torchrun, which then sets the world size:
    /tmp/torchenv/bin/torchrun --nproc-per-node 2 benches/pytorch_gpt.py --mode fsdp2
  The last line is
    pytorch <mode> world=<W> threads=<T>: <tokens/s> tokens/s (steps S, final loss L)
  with T the intra-op threads of each process.
"""

import argparse
import math
import os
import socket
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK = (1 << 64) - 1


# ----------------------------------------------------------------------------- data


class Rng:
    """SplitMix64, bit-for-bit the generator of examples/common/data.rs."""

    def __init__(self, seed, stream):
        self.state = (seed ^ ((stream * 0xD1B54A32D192ED03) & MASK)) & MASK
        self.next_u64()

    def next_u64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, n):
        return self.next_u64() % n


def my_rows(global_batch, rank, world):
    local = global_batch // world
    return range(rank * local, (rank + 1) * local)


def batch_tokens(train, seq, batch, seed, step, rank, world):
    """This rank's rows of step `step`'s global batch, [rows, seq + 1] int64."""
    width = seq + 1
    rng = Rng(seed, step)
    starts = [rng.below(len(train) - width) for _ in range(batch)]
    rows = [starts[i] for i in my_rows(batch, rank, world)]
    return torch.stack([train[s : s + width] for s in rows]).long()


def learning_rate(peak, warmup, step, last):
    """examples/common/optim.rs: linear warm-up, then cosine decay to 10 % at `last`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = float(max(last - warmup, 1))
    progress = min((step - warmup) / span, 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    def __init__(self, d, heads, attn):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm_attn = nn.LayerNorm(d, eps=1e-5)
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.output = nn.Linear(d, d)
        self.norm_mlp = nn.LayerNorm(d, eps=1e-5)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def attention(self, h):
        b, t, d = h.shape
        split = lambda x: x.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        q, k, v = split(self.query(h)), split(self.key(h)), split(self.value(h))
        if self.attn == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # burn's MultiHeadAttention: explicit scores, mask_fill(-1e4), softmax
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
            ctx = torch.softmax(scores.masked_fill(mask, -1.0e4), dim=-1) @ v
        return self.output(ctx.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.norm_attn(x))
        return x + self.down(F.gelu(self.up(self.norm_mlp(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, d, layers, heads, seq, attn):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)  # N(0, 1), as burn's EmbeddingConfig
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, attn) for _ in range(layers))
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        """Mean next-token cross-entropy of `tokens` [batch, seq + 1]."""
        inp, target = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inp.shape[1], device=tokens.device)
        x = self.embed(inp) + self.pos(positions)[None]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# ----------------------------------------------------------------------------- training


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["single", "fsdp2"], default="single")
    p.add_argument("--world", type=int, default=2, help="fsdp2 processes (default 2)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads per process (default: single all cores, "
                        "fsdp2 cores / world)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument("--warmup", type=int, default=3,
                   help="first steps excluded from the tokens/s measurement (default 3)")
    p.add_argument("--lr", type=float, default=4e-3, help="peak learning rate (default 4e-3)")
    p.add_argument("--lr-warmup", type=int, default=20,
                   help="linear learning-rate warm-up steps (train_gpt's --warmup; default 20)")
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=os.path.join(ROOT, "data", "corpus.txt"))
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda (single mode only: the same model on one GPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--tf32", action="store_true",
                   help="f32 matmuls on tensor cores in TF32 (set_float32_matmul_precision('high')): "
                        "what burn-cubecl's f32 matmul computes on GPUs that have TF32")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                   help="compute dtype: bf16 is torch.autocast in single mode and FSDP2's "
                        "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) in fsdp2 mode "
                        "(fp32 master weights either way), like train_gpt --compute bf16")
    p.add_argument("--log-every", type=int, default=None, help="default: steps / 20")
    a = p.parse_args(argv)
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup (the timed steps follow the warm-up)")
    if a.width % a.heads:
        p.error(f"--width {a.width} does not split into {a.heads} heads")
    if a.device != "cpu" and a.mode != "single":
        p.error("--device other than cpu runs in --mode single only")
    if a.mode == "single":
        a.world = 1
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        a.world = int(os.environ["WORLD_SIZE"])
    if a.threads is None:
        a.threads = max(1, (os.cpu_count() or 1) // a.world)
    return a


def train(args, rank, world, dist=None):
    torch.set_num_threads(args.threads)
    lead = rank == 0
    text = open(args.text, "rb").read()
    split = len(text) * 9 // 10
    train_bytes = torch.frombuffer(bytearray(text[:split]), dtype=torch.uint8)
    if args.batch % world:
        raise SystemExit(f"the global batch of {args.batch} does not split over {world} ranks")

    if args.tf32:
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(args.seed)  # same init on every rank; FSDP2 keeps each rank's shard
    device = torch.device(args.device)
    model = Gpt(256, args.width, args.layers, args.heads, args.seq, args.attn).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    forward = torch.compile(model) if args.compile else model
    if dist is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from torch.distributed.fsdp import MixedPrecisionPolicy

        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if args.dtype == "bf16" else None,
            reduce_dtype=torch.float32 if args.dtype == "bf16" else None)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    # Single process in bf16: autocast (matmuls in bf16 on fp32 weights, AMP's usual path).
    autocast = args.dtype == "bf16" and dist is None
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-5,
                              weight_decay=0.01)
    if lead:
        print(f"corpus: {split} training + {len(text) - split} held-out bytes")
        print(f"pytorch {torch.__version__}: {n_params / 1e6:.2f}M parameters; width "
              f"{args.width}, {args.layers} layers, {args.heads} heads, context {args.seq}, "
              f"global batch {args.batch}; mode {args.mode}, world {world}, threads "
              f"{torch.get_num_threads()}/process; AdamW lr {args.lr:g} (warm-up "
              f"{args.lr_warmup}, cosine), clip {args.clip or 'off'}, {args.dtype}"
              f"{' (tf32 matmuls)' if args.tf32 else ''}, attn {args.attn}, "
              f"device {args.device}{', compiled' if args.compile else ''}", flush=True)

    def global_mean(values):
        t = torch.tensor(values, dtype=torch.float64)
        if dist is not None:
            dist.all_reduce(t)  # gloo has no AVG
            t /= world
        return t.tolist()

    log_every = args.log_every or max(args.steps // 20, 1)
    losses, timed = [], 0.0
    for step in range(args.steps):
        tokens = batch_tokens(train_bytes, args.seq, args.batch, args.seed, step, rank, world)
        tokens = tokens.to(device)
        t0 = time.perf_counter()
        for group in optim.param_groups:
            group["lr"] = learning_rate(args.lr, args.lr_warmup, step, args.steps)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = forward(tokens)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        local = loss.item()  # waits for the device
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            timed += dt
        losses.append(local)
        done = step + 1 == args.steps
        if step % log_every == 0 or done:
            g = global_mean([local])[0]
            if lead:
                print(f"step {step:>5}  loss {g:.4f}  lr {optim.param_groups[0]['lr']:.2e}  "
                      f"{args.batch * args.seq / dt:.0f} tok/s", flush=True)
    losses = global_mean(losses)
    if dist is not None:  # the slowest rank's time
        t = torch.tensor([timed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        timed = t.item()
    tail = losses[-20:]
    rate = args.batch * args.seq * (args.steps - args.warmup) / timed
    if lead:
        print(f"pytorch {args.mode} world={world} threads={torch.get_num_threads()} "
              f"device={args.device} dtype={args.dtype}{' tf32' if args.tf32 else ''} "
              f"attn={args.attn}{' compiled' if args.compile else ''}: "
              f"{rate:.1f} tokens/s (steps {args.steps}, final loss {sum(tail) / len(tail):.4f})",
              flush=True)


def fsdp_worker(rank, world, args, port):
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(args, rank, world, dist)
    finally:
        dist.destroy_process_group()


def main():
    args = parse_args()
    if args.mode == "single":
        train(args, 0, 1)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        fsdp_worker(int(os.environ["RANK"]), args.world, args, os.environ.get("MASTER_PORT", 0))
    else:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(fsdp_worker, args=(args.world, args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
