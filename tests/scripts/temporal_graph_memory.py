"""A temporal graph network trained with AMP, written the way PyG's TGN example is: a memory module keeps one state
per node in buffers, updated in its forward from the events of the batch; a time encoder (``lin``, then cos) encodes
the time since a node was last seen, in raw seconds.

It knows nothing of fp16doctor. As the stream goes on, the time since a node's last event reaches tens of thousands
of seconds: ``time_enc.lin`` multiplies it into values past 65504, inf in fp16, and the GRU writes NaN into the
memory of those nodes in the same forward.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn


class TimeEncoder(nn.Module):
    def __init__(self, out_channels):
        super().__init__()
        self.lin = nn.Linear(1, out_channels)

    def forward(self, t):
        return self.lin(t.view(-1, 1)).cos()


class NodeMemory(nn.Module):
    """One memory vector per node and the time it was last updated, both written back in forward."""

    def __init__(self, num_nodes, memory_dim, msg_dim, time_dim):
        super().__init__()
        self.time_enc = TimeEncoder(time_dim)
        self.gru = nn.GRUCell(msg_dim + time_dim + memory_dim, memory_dim)
        self.register_buffer("memory", torch.zeros(num_nodes, memory_dim))
        self.register_buffer("last_update", torch.zeros(num_nodes))

    def forward(self, src, dst, t, msg):
        rel_t = (t - self.last_update[src]).to(msg.dtype)
        enc = self.time_enc(rel_t)
        state = self.gru(torch.cat([msg, enc, self.memory[dst]], dim=-1), self.memory[src])
        with torch.no_grad():  # the new state is kept for the next batch, outside the graph
            self.memory[src] = state.detach().to(self.memory.dtype)
            self.last_update[src] = t
        return state


class LinkPredictor(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin_src = nn.Linear(dim, dim)
        self.lin_dst = nn.Linear(dim, dim)
        self.lin_final = nn.Linear(dim, 1)

    def forward(self, z_src, z_dst):
        return self.lin_final((self.lin_src(z_src) + self.lin_dst(z_dst)).relu())


class TGN(nn.Module):
    def __init__(self, num_nodes, memory_dim=32, msg_dim=8, time_dim=16):
        super().__init__()
        self.memory = NodeMemory(num_nodes, memory_dim, msg_dim, time_dim)
        self.embed = nn.Embedding(num_nodes, memory_dim)
        self.link_pred = LinkPredictor(memory_dim)

    def forward(self, src, dst, neg_dst, t, msg):
        z_src = self.memory(src, dst, t, msg) + self.embed(src)
        z_dst, z_neg = self.embed(dst), self.embed(neg_dst)
        return self.link_pred(z_src, z_dst), self.link_pred(z_src, z_neg)


def event_stream(num_nodes, num_events, batch_size, seconds, generator):
    """Interactions (src, dst, time, message) sorted by time, timestamps in seconds; a node is the source of at most
    one event per batch (its memory is written once per batch)."""
    batches = range(0, num_events, batch_size)
    src = torch.cat([torch.randperm(num_nodes, generator=generator)[:batch_size] for _ in batches])[:num_events]
    dst = torch.randint(0, num_nodes, (num_events,), generator=generator)
    t = torch.sort(torch.rand(num_events, generator=generator) * seconds).values
    msg = torch.randn(num_events, 8, generator=generator)
    return src, dst, t, msg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=400)
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--seconds", type=float, default=2.0e5)
    parser.add_argument("--batch-size", type=int, default=200)
    args = parser.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    src, dst, t, msg = event_stream(args.nodes, args.events, args.batch_size, args.seconds, g)
    model = TGN(args.nodes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    for step, start in enumerate(range(0, args.events, args.batch_size)):
        batch = slice(start, start + args.batch_size)
        neg_dst = torch.randint(0, args.nodes, (src[batch].numel(),), generator=g)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            pos_out, neg_out = model(src[batch], dst[batch], neg_dst, t[batch], msg[batch])
        loss = F.binary_cross_entropy_with_logits(pos_out.float(), torch.ones_like(pos_out.float()))
        loss = loss + F.binary_cross_entropy_with_logits(neg_out.float(), torch.zeros_like(neg_out.float()))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        print(f"step {step} loss {loss.item():.4f} scale {scaler.get_scale():g}", flush=True)


if __name__ == "__main__":
    main()
