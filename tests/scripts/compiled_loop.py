"""A compiled training script, nanoGPT style: the model compiled once (or in place, `model.compile()`), fp16
autocast with a GradScaler, AdamW. It prints each loss bit for bit (hex) and, at the end, what dynamo counted:
the graphs it compiled and the graph breaks. `--poison-step K` puts an inf in step K's batch."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--poison-step", type=int, default=-1)
parser.add_argument("--mode", default=None)
parser.add_argument("--in-place", action="store_true", help="model.compile() instead of torch.compile(model)")
parser.add_argument("--compile-step", action="store_true", help="compile the forward and loss as one function")
parser.add_argument("--compile-blocks", action="store_true", help="compile each block, the model around them eager")
parser.add_argument("--compile-blocks-in-place", action="store_true", help="block.compile() per block (torchtitan)")
args = parser.parse_args()

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width=32, classes=5):
        super().__init__()
        self.embed = nn.Linear(12, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(2)])
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
if args.in_place:
    model.compile(mode=args.mode, dynamic=False)
    step_model = model
elif args.compile_blocks_in_place:
    for block in model.blocks:
        block.compile(mode=args.mode, dynamic=False)
    step_model = model
elif args.compile_blocks:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, mode=args.mode, dynamic=False)
    step_model = model
elif not args.compile_step:
    step_model = torch.compile(model, mode=args.mode, dynamic=False)


@torch.compile(mode=args.mode, dynamic=False, disable=not args.compile_step)
def forward_and_loss(x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy((model if args.compile_step else step_model)(x), y)


for step in range(args.steps):
    x, y = torch.randn(16, 12), torch.randint(0, 5, (16,))
    if step == args.poison_step:
        x[0, 0] = float("inf")
    loss = forward_and_loss(x, y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item().hex()}", flush=True)
print(f"graphs {counters['stats']['unique_graphs']} breaks {sum(counters['graph_break'].values())}", flush=True)
