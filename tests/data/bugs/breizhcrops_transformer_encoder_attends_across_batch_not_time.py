# dl4sits/BreizhCrops#20, fixed in commit 796a923c6e4fdbbd856b57573172e67c0fa62321 ("fixed Transformer attention bug").
# TransformerModel fed the N x T x D batch of crop time series straight into nn.TransformerEncoder, which
# expects T x N x D, so self-attention ran across the parcels of the batch at each time step instead of
# across the time steps of one parcel. The fix transposes to T x N x D around the encoder (and max-pools over time).
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import LayerNorm, Linear, ReLU, Sequential
from torch.nn.modules.transformer import TransformerEncoder, TransformerEncoderLayer

FIXED = "--fixed" in sys.argv


class Flatten(nn.Module):
    def forward(self, input):
        if FIXED:
            return input.reshape(input.size(0), -1)
        return input.view(input.size(0), -1)


if not FIXED:
    class TransformerModel(nn.Module):
        def __init__(self, input_dim=13, num_classes=9, sequencelength=13, d_model=64, n_head=1, n_layers=3,
                     d_inner=256, activation="relu", dropout=0.39907201621346594):

            super(TransformerModel, self).__init__()
            self.modelname = f"TransformerEncoder_input-dim={input_dim}_num-classes={num_classes}_" \
                             f"d-model={d_model}_d-inner={d_inner}_n-layers={n_layers}_n-head={n_head}_" \
                             f"dropout={dropout}"

            encoder_layer = TransformerEncoderLayer(d_model, n_head, d_inner, dropout, activation)
            encoder_norm = LayerNorm(d_model)

            self.sequential = Sequential(
                Linear(input_dim, d_model),
                ReLU(),
                TransformerEncoder(encoder_layer, n_layers, encoder_norm),
                Flatten(),
                ReLU(),
                Linear(d_model * sequencelength, num_classes)
            )

        def forward(self, x):
            logits = self.sequential(x)
            logprobabilities = F.log_softmax(logits, dim=-1)
            return logprobabilities
else:
    class TransformerModel(nn.Module):
        def __init__(self, input_dim=13, num_classes=9, d_model=64, n_head=1, n_layers=3,
                     d_inner=256, activation="relu", dropout=0.39907201621346594):

            super(TransformerModel, self).__init__()
            self.modelname = f"TransformerEncoder_input-dim={input_dim}_num-classes={num_classes}_" \
                             f"d-model={d_model}_d-inner={d_inner}_n-layers={n_layers}_n-head={n_head}_" \
                             f"dropout={dropout}"

            encoder_layer = TransformerEncoderLayer(d_model, n_head, d_inner, dropout, activation)
            encoder_norm = LayerNorm(d_model)

            self.inlinear = Linear(input_dim, d_model)
            self.relu = ReLU()
            self.transformerencoder = TransformerEncoder(encoder_layer, n_layers, encoder_norm)
            self.flatten = Flatten()
            self.outlinear = Linear(d_model, num_classes)

        def forward(self, x):
            x = self.inlinear(x)
            x = self.relu(x)
            x = x.transpose(0, 1)  # N x T x D -> T x N x D
            x = self.transformerencoder(x)
            x = x.transpose(0, 1)  # T x N x D -> N x T x D
            x = x.max(1)[0]
            x = self.relu(x)
            logits = self.outlinear(x)

            logprobabilities = F.log_softmax(logits, dim=-1)
            return logprobabilities


def get_model(model, ndims, num_classes, sequencelength, device, **hyperparameter):
    if model == "TransformerEncoder":
        if FIXED:
            model = TransformerModel(input_dim=ndims, num_classes=num_classes,
                                     activation="relu",
                                     **hyperparameter).to(device)
        else:
            model = TransformerModel(input_dim=ndims, num_classes=num_classes, sequencelength=sequencelength,
                                     activation="relu",
                                     **hyperparameter).to(device)
    else:
        raise ValueError("invalid model argument")
    return model


def train_epoch(model, optimizer, criterion, dataloader, device):
    model.train()
    losses = list()
    for idx, batch in enumerate(dataloader):
        optimizer.zero_grad()
        x, y_true = batch
        loss = criterion(model.forward(x.to(device)), y_true.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss)
    return torch.stack(losses)


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument('model', type=str, nargs='?', default="TransformerEncoder")
    parser.add_argument('-b', '--batchsize', type=int, default=8)
    parser.add_argument('--weight-decay', type=float, default=1e-6)
    parser.add_argument('--learning-rate', type=float, default=1e-2)
    parser.add_argument('--fixed', action="store_true")
    args = parser.parse_args()
    args.hyperparameter = dict()
    return args


def main():
    torch.manual_seed(0)
    args = parse_args()
    device = torch.device("cpu")
    # a small synthetic stand-in for the BreizhCrops L1C parcels: 13 bands, 45 observations, 9 classes
    ndims, num_classes, sequencelength = 13, 9, 45
    x = torch.randn(4 * args.batchsize, sequencelength, ndims)
    y = torch.randint(0, num_classes, (4 * args.batchsize,))
    traindataloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                  batch_size=args.batchsize, shuffle=False)

    model = get_model(args.model, ndims, num_classes, sequencelength, device, **args.hyperparameter)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    criterion = torch.nn.CrossEntropyLoss(reduction="mean")

    train_loss = train_epoch(model, optimizer, criterion, traindataloader, device)
    print(f"train loss {train_loss.mean().item():.4f}")


if __name__ == "__main__":
    main()
