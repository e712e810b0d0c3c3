# Citation: Mathux/ACTOR @c7237e82e333bf2c57f7d8e12f27d0831233befc: src/models/architectures/transformer.py
#   (PositionalEncoding, Encoder_TRANSFORMER, Decoder_TRANSFORMER), src/models/modeltype/cae.py (CAE.forward,
#   lengths_to_mask), src/models/modeltype/cvae.py (CVAE.reparameterize / forward), src/utils/tensors.py
#   (lengths_to_mask, collate_tensors, collate), src/models/tools/losses.py (compute_rc_loss, compute_kl_loss).
# ACTOR's action-conditioned motion VAE. Motions of different durations are zero-padded at the end of the frame axis
# by `collate`, which keeps the lengths beside the batch and turns them into a (bs, nframes) bool mask, True = real.
# The encoder is a sequence-first nn.TransformerEncoder: two per-class tokens (muQuery[y], sigmaQuery[y]) are put in
# front of the frames, the mask is widened with two always-True columns, and `src_key_padding_mask=~maskseq` hides
# the padded frames; mu / logvar are read at sequence positions 0 and 1. The decoder is a sequence-first
# nn.TransformerDecoder whose queries are the positional encodings of every frame, `tgt_key_padding_mask=~mask`
# hides the padded frames as keys, the memory is the single latent token, and padded output frames are zeroed.
# Self-check: each motion run alone at its own length (mask all True) gives the same mu, logvar, output frames, and
# the reconstruction and KL losses of the padded batch equal those summed over the motions alone.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---- src/utils/tensors.py ----
def lengths_to_mask(lengths):
    max_len = max(lengths)
    mask = torch.arange(max_len, device=lengths.device).expand(len(lengths), max_len) < lengths.unsqueeze(1)
    return mask


def collate_tensors(batch):
    dims = batch[0].dim()
    max_size = [max([b.size(i) for b in batch]) for i in range(dims)]
    size = (len(batch),) + tuple(max_size)
    canvas = batch[0].new_zeros(size=size)
    for i, b in enumerate(batch):
        sub_tensor = canvas[i]
        for d in range(dims):
            sub_tensor = sub_tensor.narrow(d, 0, b.size(d))
        sub_tensor.add_(b)
    return canvas


def collate(batch):
    databatch = [b[0] for b in batch]
    labelbatch = [b[1] for b in batch]
    lenbatch = [len(b[0][0][0]) for b in batch]

    databatchTensor = collate_tensors(databatch)
    labelbatchTensor = torch.as_tensor(labelbatch)
    lenbatchTensor = torch.as_tensor(lenbatch)

    maskbatchTensor = lengths_to_mask(lenbatchTensor)
    batch = {"x": databatchTensor, "y": labelbatchTensor,
             "mask": maskbatchTensor, "lengths": lenbatchTensor}
    return batch


# ---- src/models/architectures/transformer.py ----
class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout=0.1, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)

        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-np.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0).transpose(0, 1)

        self.register_buffer('pe', pe)

    def forward(self, x):
        x = x + self.pe[:x.shape[0], :]
        return self.dropout(x)


class Encoder_TRANSFORMER(nn.Module):
    def __init__(self, njoints, nfeats, num_classes, latent_dim=256, ff_size=1024, num_layers=4, num_heads=4,
                 dropout=0.1, activation="gelu"):
        super().__init__()
        self.njoints = njoints
        self.nfeats = nfeats
        self.num_classes = num_classes
        self.latent_dim = latent_dim
        self.input_feats = self.njoints * self.nfeats

        self.muQuery = nn.Parameter(torch.randn(self.num_classes, self.latent_dim))
        self.sigmaQuery = nn.Parameter(torch.randn(self.num_classes, self.latent_dim))

        self.skelEmbedding = nn.Linear(self.input_feats, self.latent_dim)
        self.sequence_pos_encoder = PositionalEncoding(self.latent_dim, dropout)

        seqTransEncoderLayer = nn.TransformerEncoderLayer(d_model=self.latent_dim,
                                                          nhead=num_heads,
                                                          dim_feedforward=ff_size,
                                                          dropout=dropout,
                                                          activation=activation)
        self.seqTransEncoder = nn.TransformerEncoder(seqTransEncoderLayer,
                                                     num_layers=num_layers)

    def forward(self, batch):
        x, y, mask = batch["x"], batch["y"], batch["mask"]
        bs, njoints, nfeats, nframes = x.shape
        x = x.permute((3, 0, 1, 2)).reshape(nframes, bs, njoints * nfeats)

        # embedding of the skeleton
        x = self.skelEmbedding(x)

        # adding the mu and sigma queries
        xseq = torch.cat((self.muQuery[y][None], self.sigmaQuery[y][None], x), axis=0)

        # add positional encoding
        xseq = self.sequence_pos_encoder(xseq)

        # create a bigger mask, to allow attend to mu and sigma
        muandsigmaMask = torch.ones((bs, 2), dtype=bool, device=x.device)
        maskseq = torch.cat((muandsigmaMask, mask), axis=1)

        final = self.seqTransEncoder(xseq, src_key_padding_mask=~maskseq)
        mu = final[0]
        logvar = final[1]

        return {"mu": mu, "logvar": logvar}


class Decoder_TRANSFORMER(nn.Module):
    def __init__(self, njoints, nfeats, num_classes, latent_dim=256, ff_size=1024, num_layers=4, num_heads=4,
                 dropout=0.1, activation="gelu"):
        super().__init__()
        self.njoints = njoints
        self.nfeats = nfeats
        self.num_classes = num_classes
        self.latent_dim = latent_dim
        self.input_feats = self.njoints * self.nfeats

        self.actionBiases = nn.Parameter(torch.randn(self.num_classes, self.latent_dim))
        self.sequence_pos_encoder = PositionalEncoding(self.latent_dim, dropout)

        seqTransDecoderLayer = nn.TransformerDecoderLayer(d_model=self.latent_dim,
                                                          nhead=num_heads,
                                                          dim_feedforward=ff_size,
                                                          dropout=dropout,
                                                          activation=activation)
        self.seqTransDecoder = nn.TransformerDecoder(seqTransDecoderLayer,
                                                     num_layers=num_layers)

        self.finallayer = nn.Linear(self.latent_dim, self.input_feats)

    def forward(self, batch):
        z, y, mask, lengths = batch["z"], batch["y"], batch["mask"], batch["lengths"]

        latent_dim = z.shape[1]
        bs, nframes = mask.shape
        njoints, nfeats = self.njoints, self.nfeats

        # shift the latent noise vector to be the action noise
        z = z + self.actionBiases[y]
        z = z[None]  # sequence of size 1

        timequeries = torch.zeros(nframes, bs, latent_dim, device=z.device)
        timequeries = self.sequence_pos_encoder(timequeries)

        output = self.seqTransDecoder(tgt=timequeries, memory=z,
                                      tgt_key_padding_mask=~mask)

        output = self.finallayer(output).reshape(nframes, bs, njoints, nfeats)

        # zero for padded area
        output[~mask.T] = 0
        output = output.permute(1, 2, 3, 0)

        batch["output"] = output
        return batch


# ---- src/models/tools/losses.py ----
def compute_rc_loss(model, batch):
    x = batch["x"]
    output = batch["output"]
    mask = batch["mask"]

    gtmasked = x.permute(0, 3, 1, 2)[mask]
    outmasked = output.permute(0, 3, 1, 2)[mask]

    loss = F.mse_loss(gtmasked, outmasked, reduction='mean')
    return loss


def compute_kl_loss(model, batch):
    mu, logvar = batch["mu"], batch["logvar"]
    loss = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return loss


# ---- src/models/modeltype/cae.py + cvae.py (no xyz output: pose_rep "rot6d", outputxyz False) ----
class CVAE(nn.Module):
    def __init__(self, encoder, decoder, lambdas):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.lambdas = lambdas

    def reparameterize(self, batch, eps):
        # cvae.py draws eps = std.data.new(std.size()).normal_(); here the draw is handed in so that a motion run
        # alone gets the same noise as in the batch.
        mu, logvar = batch["mu"], batch["logvar"]
        std = torch.exp(logvar / 2)
        z = eps.mul(std).add_(mu)
        return z

    def forward(self, batch, eps):
        batch.update(self.encoder(batch))
        batch["z"] = self.reparameterize(batch, eps)
        batch.update(self.decoder(batch))
        return batch

    def compute_loss(self, batch):
        mixed_loss = 0
        losses = {}
        for ltype, lam in self.lambdas.items():
            loss_function = {"rc": compute_rc_loss, "kl": compute_kl_loss}[ltype]
            loss = loss_function(self, batch)
            mixed_loss += loss * lam
            losses[ltype] = loss
        losses["mixed"] = mixed_loss
        return mixed_loss, losses


def main():
    njoints, nfeats, num_classes, latent_dim = 5, 6, 4, 32
    kw = dict(latent_dim=latent_dim, ff_size=64, num_layers=2, num_heads=4, dropout=0.1, activation="gelu")
    encoder = Encoder_TRANSFORMER(njoints, nfeats, num_classes, **kw)
    decoder = Decoder_TRANSFORMER(njoints, nfeats, num_classes, **kw)
    model = CVAE(encoder, decoder, lambdas={"rc": 1.0, "kl": 1e-5})
    model.eval()

    # dataset items are (x of shape (njoints, nfeats, nframes), action label), durations differ
    durations = [11, 4, 16, 7]
    labels = [2, 0, 3, 2]
    items = [(torch.randn(njoints, nfeats, n), y) for n, y in zip(durations, labels)]
    eps = torch.randn(len(items), latent_dim)

    with torch.no_grad():
        batch = collate(items)
        assert batch["x"].shape == (4, njoints, nfeats, max(durations))
        assert batch["lengths"].tolist() == durations
        out = model(batch, eps)
        _, losses = model.compute_loss(out)

        n_real_total = sum(durations)
        rc_sum = 0.0
        kl_sum = 0.0
        for i, (x_i, y_i) in enumerate(items):
            alone = collate([(x_i, y_i)])
            assert bool(alone["mask"].all())
            ref = model(alone, eps[i:i + 1])
            n = durations[i]
            torch.testing.assert_close(out["mu"][i], ref["mu"][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out["logvar"][i], ref["logvar"][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out["z"][i], ref["z"][0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(out["output"][i, ..., :n], ref["output"][0], rtol=1e-4, atol=1e-5)
            assert bool((out["output"][i, ..., n:] == 0).all())
            rc_sum = rc_sum + ((ref["output"][0] - x_i) ** 2).sum()
            kl_i = -0.5 * torch.sum(1 + ref["logvar"] - ref["mu"].pow(2) - ref["logvar"].exp())
            kl_sum = kl_sum + kl_i

        rc_ref = rc_sum / (n_real_total * njoints * nfeats)
        torch.testing.assert_close(losses["rc"], rc_ref, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(losses["kl"], kl_sum, rtol=1e-4, atol=1e-4)

    print("ok: mu/logvar/z/output of %d padded motions match each motion alone; rc %.5f kl %.3f"
          % (len(items), float(losses["rc"]), float(losses["kl"])))


if __name__ == "__main__":
    main()
