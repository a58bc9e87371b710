"""VAE on 28x28 binarised digits, straight from pytorch/examples/vae/main.py
(fc layers, sigmoid decoder, BCE + KLD). Trying AMP to speed up the sweep.
"""
import torch
from torch import nn
import torch.nn.functional as F

CONFIG = {"steps": 20, "lr": 1e-3}


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 784))
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


# Reconstruction + KL divergence losses summed over all elements and batch
def loss_function(recon_x, x, mu, logvar):
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 784), reduction='sum')
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def model():
    return VAE()


def data():
    # fake "MNIST": random strokes, binarised
    g = torch.Generator().manual_seed(0)
    protos = (torch.rand(10, 1, 28, 28, generator=g) > 0.8).float()
    for _ in range(CONFIG["steps"]):
        y = torch.randint(0, 10, (128,), generator=g)
        noise = (torch.rand(128, 1, 28, 28, generator=g) > 0.95).float()
        yield (protos[y] + noise).clamp(max=1.0)


def loss(model, data):
    recon_batch, mu, logvar = model(data)
    return loss_function(recon_batch, data, mu, logvar) / len(data)


def optimizer(params):
    return torch.optim.Adam(params, lr=1e-3)
