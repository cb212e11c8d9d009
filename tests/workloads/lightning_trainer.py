# A LightningModule fitted by lightning.pytorch.Trainer(strategy="ddp") on CPU, in the style of
# Lightning's "Lightning in 15 minutes": the model, training_step and configure_optimizers.
#   torchrun --standalone --nproc-per-node 2 lightning_trainer.py [--out DIR]
# Cells (`# %%`): setup, first fit (1 epoch), second fit (1 more epoch, same model) + losses file.
import argparse
import json
import os

import lightning.pytorch as pl
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--out", default=os.environ.get("NBDIST_WORKLOAD_OUT", "."))
args = parser.parse_args()

torch.set_num_threads(1)


class Regressor(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        # plain SGD keeps no state, so the second fit's new optimizer goes on where the first was
        return torch.optim.SGD(self.parameters(), lr=self.lr)


pl.seed_everything(0)
model = Regressor(args.lr)
data_gen = torch.Generator().manual_seed(1234)
true_w = torch.randn(16, 1, generator=data_gen)
X = torch.randn(10 * args.batch * 2, 16, generator=data_gen)
Y = torch.tanh(X @ true_w) + 0.01 * torch.randn(X.shape[0], 1, generator=data_gen)
train_loader = DataLoader(TensorDataset(X, Y), batch_size=args.batch)


def fit_one_epoch():
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.out)
    trainer.fit(model, train_loader)  # the Trainer adds a DistributedSampler: half per rank
    return trainer


# %%
trainer = fit_one_epoch()

# %%
trainer = fit_one_epoch()
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, f"losses-rank{trainer.global_rank}.json"), "w") as f:
    json.dump(model.losses, f)
