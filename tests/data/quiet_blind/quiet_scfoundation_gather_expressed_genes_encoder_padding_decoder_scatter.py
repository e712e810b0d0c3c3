"""scFoundation (xTrimoGene) MAE-autobin forward on a batch of cells: the encoder reads only each
cell's expressed genes (a ragged set, padded), the decoder reads every gene.

Port, shrunk to tiny sizes, of biomap-research/scFoundation
@948a8ccb950d096148cf03418d870acdcadebd7b model/load.py (gatherData, getEncoerDecoderData),
model/get_embedding.py @69b0710660aded7e071d4f67e9f3ac03b096e587 ('gene_batch' output type),
model/pretrainmodels/mae_autobin.py (MaeAutobin.forward, AutoDiscretizationEmbedding2; text read in
the fork xbbq/scf @fed0997bfe836ed115e87939ef6bbb570c25b807) and the pytorchTransformerModule
encoder (nn.TransformerEncoderLayer, batch_first, src_key_padding_mask):

* gatherData keeps, per cell, the genes with value > 0 in their original order (topk over
  `label + (i+1)*20000` with -inf for zeros), appends `max_num` pad columns so every row can be
  filled, and returns `padding_labels = (new_data == pad_token_id)` (True = pad, key padding mask).
* The gathered gene ids get the same treatment; padded slots are then pointed at the extra
  position-embedding row `seq_len`.
* The encoder runs with `src_key_padding_mask = padding_label`; the decoder input is every gene of
  the cell (its own padding mask is all False) and the encoder outputs are scattered back with
  `decoder_data[(encoder_labels == True).nonzero()] = x[~padding_label]`.
  (scFoundation's released decoder is a Performer; here the decoder is the same pytorch
  transformer module, which select_model also offers.)

Check: each cell run alone (batch of one, no padding at all, exactly as get_embedding.py's 'gene'
path), through a per-query-loop re-implementation of the encoder layers; the batched decoder output
for every gene must match. The fully padded positions are never read back.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ------------------------------------------------------------------ model/load.py
def gatherData(data, labels, pad_token_id):
    value_nums = labels.sum(1)
    max_num = max(value_nums)

    fake_data = torch.full((data.shape[0], max_num), pad_token_id, device=data.device)
    data = torch.hstack([data, fake_data])

    fake_label = torch.full((labels.shape[0], max_num), 1, device=labels.device)
    none_labels = ~labels
    labels = labels.float()
    labels[none_labels] = torch.tensor(-float('Inf'), device=labels.device)

    tmp_data = torch.tensor([(i + 1) * 20000 for i in range(labels.shape[1], 0, -1)], device=labels.device)
    labels += tmp_data

    labels = torch.hstack([labels, fake_label])

    fake_label_gene_idx = labels.topk(max_num).indices

    new_data = torch.gather(data, 1, fake_label_gene_idx)

    padding_labels = (new_data == pad_token_id)

    return new_data, padding_labels


def getEncoerDecoderData(data, data_raw, config):
    decoder_data = data.clone().detach()
    decoder_data_padding = torch.full_like(data, False, dtype=torch.bool).to(data.device)

    encoder_data_labels = data_raw > 0
    encoder_data, encoder_data_padding = gatherData(decoder_data, encoder_data_labels, config['pad_token_id'])
    new_data_raw = data_raw
    data_gene_ids = torch.arange(data.shape[1], device=data.device).repeat(data.shape[0], 1)
    encoder_position_gene_ids, _ = gatherData(data_gene_ids, encoder_data_labels, config['pad_token_id'])
    decoder_position_gene_ids = data_gene_ids
    data_mask_labels = None

    encoder_position_gene_ids[encoder_data_padding] = config["seq_len"]
    decoder_position_gene_ids[decoder_data_padding] = config["seq_len"]

    return (encoder_data, encoder_position_gene_ids, encoder_data_padding, encoder_data_labels,
            decoder_data, decoder_data_padding, new_data_raw, data_mask_labels, decoder_position_gene_ids)


# ------------------------------------------------------------------ pretrainmodels
class AutoDiscretizationEmbedding2(nn.Module):
    def __init__(self, dim, max_seq_len, bin_num, bin_alpha, mask_token_id=None, pad_token_id=None):
        super().__init__()
        self.dim = dim
        self.max_seq_len = max_seq_len
        self.bin_num = bin_num
        self.bin_alpha = bin_alpha
        self.mlp = nn.Linear(1, self.bin_num)
        self.mlp2 = nn.Linear(self.bin_num, self.bin_num)
        self.LeakyReLU = nn.LeakyReLU(0.1)
        self.Softmax = nn.Softmax(dim=-1)
        self.emb = nn.Embedding(self.bin_num, self.dim)
        self.emb_mask = nn.Embedding(1, self.dim)
        self.emb_pad = nn.Embedding(1, self.dim)
        self.bin_num_idx = torch.tensor(range(self.bin_num))
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id

    def forward(self, x, output_weight=0):
        x_mask_idx = (x == self.mask_token_id).nonzero()
        x_pad_idx = (x == self.pad_token_id).nonzero()
        x = self.mlp(x)
        x = self.LeakyReLU(x)
        x_crosslayer = self.mlp2(x)
        x = self.bin_alpha * x + x_crosslayer
        weight = self.Softmax(x)
        token_emb = self.emb(self.bin_num_idx.to(x.device))
        x = torch.matmul(weight, token_emb)
        tensor0 = torch.tensor(0, dtype=torch.long, device=x.device)
        mask_token_emb = self.emb_mask(tensor0).to(x.device).type(x.dtype)
        x[x_mask_idx[:, 0], x_mask_idx[:, 1], :] = mask_token_emb.repeat(x_mask_idx.shape[0], 1)
        pad_token_emb = self.emb_pad(tensor0).to(x.device).type(x.dtype)
        x[x_pad_idx[:, 0], x_pad_idx[:, 1], :] = pad_token_emb.repeat(x_pad_idx.shape[0], 1)
        if output_weight:
            return x, weight
        return x


class pytorchTransformerModule(nn.Module):
    def __init__(self, max_seq_len, dim, depth, heads, ff_mult=4, norm_first=False):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.depth = depth
        layers = []
        for i in range(depth):
            layers.append(nn.TransformerEncoderLayer(d_model=dim, nhead=heads, dim_feedforward=dim * ff_mult,
                                                     batch_first=True, norm_first=norm_first, dropout=0.0))
        self.transformer_encoder = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, padding_mask):
        b, n, _, device = *x.shape, x.device
        assert n <= self.max_seq_len, f'sequence length {n} must be less than the max sequence length {self.max_seq_len}'
        for mod in self.transformer_encoder:
            x = mod(x, src_key_padding_mask=padding_mask)
        x = self.norm(x)
        return x


def exists(val):
    return val is not None


class MaeAutobin(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, embed_dim, decoder_embed_dim, bin_alpha=1.0, bin_num=10,
                 pad_token_id=None, mask_token_id=None):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.num_tokens = num_tokens
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.token_emb = AutoDiscretizationEmbedding2(embed_dim, max_seq_len, bin_num=bin_num, bin_alpha=bin_alpha,
                                                      pad_token_id=self.pad_token_id, mask_token_id=self.mask_token_id)
        self.pos_emb = nn.Embedding(max_seq_len + 1, embed_dim)
        self.encoder = None
        self.decoder = None
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim, bias=True)
        self.norm = nn.LayerNorm(decoder_embed_dim)
        self.to_final = nn.Linear(decoder_embed_dim, 1)

    def forward(self, x, padding_label, encoder_position_gene_ids, encoder_labels, decoder_data,
                mask_gene_name, mask_labels, decoder_position_gene_ids, decoder_data_padding_labels, **kwargs):
        b, n, device = *x.shape, x.device
        assert n <= self.max_seq_len
        x = self.token_emb(torch.unsqueeze(x, 2), output_weight=0)
        position_emb = self.pos_emb(encoder_position_gene_ids)
        x += position_emb
        x = self.encoder(x, padding_mask=padding_label)

        decoder_data = self.token_emb(torch.unsqueeze(decoder_data, 2))
        position_emb = self.pos_emb(decoder_position_gene_ids)
        batch_idx, gen_idx = (encoder_labels == True).nonzero(as_tuple=True)
        decoder_data[batch_idx, gen_idx] = x[~padding_label].to(decoder_data.dtype)
        decoder_data += position_emb
        decoder_data = self.decoder_embed(decoder_data)
        x = self.decoder(decoder_data, padding_mask=decoder_data_padding_labels)
        x = self.norm(x)
        if exists(self.to_final):
            x = self.to_final(x)
            return x.squeeze(2)
        return x


# ------------------------------------------------------------------ independent reference
def ref_layer(layer, x):
    """Post-LN nn.TransformerEncoderLayer on one unpadded sequence (L, D), per-query loop."""
    attn = layer.self_attn
    L, D = x.shape
    H = attn.num_heads
    hd = D // H
    qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = qkv.split(D, dim=-1)
    q, k, v = (t.view(L, H, hd) for t in (q, k, v))
    out = torch.zeros(L, H, hd)
    for i in range(L):
        for h in range(H):
            s = torch.stack([(q[i, h] @ k[j, h]) / math.sqrt(hd) for j in range(L)])
            out[i, h] = (torch.softmax(s, 0)[:, None] * v[:, h]).sum(0)
    a = attn.out_proj(out.reshape(L, D))
    x = layer.norm1(x + a)
    x = layer.norm2(x + layer.linear2(layer.activation(layer.linear1(x))))
    return x


def ref_module(mod, x):
    for layer in mod.transformer_encoder:
        x = ref_layer(layer, x)
    return mod.norm(x)


def ref_cell(model, values, pad_token_id, seq_len):
    """One cell, its expressed genes only (no padding), then all genes through the decoder."""
    expressed = torch.nonzero(values > 0).flatten()
    enc_in = model.token_emb(values[expressed][None, :, None])[0] + model.pos_emb(expressed)
    enc_out = ref_module(model.encoder, enc_in)
    dec_in = model.token_emb(values[None, :, None])[0].clone()
    dec_in[expressed] = enc_out
    dec_in = dec_in + model.pos_emb(torch.arange(values.shape[0]))
    dec_out = ref_module(model.decoder, model.decoder_embed(dec_in))
    return model.norm(dec_out)


def main():
    n_genes = 10
    seq_len = n_genes + 2                       # genes + [T, S] total-count tokens
    config = {'pad_token_id': 103, 'mask_token_id': 102, 'seq_len': seq_len}
    model = MaeAutobin(num_tokens=13, max_seq_len=seq_len, embed_dim=16, decoder_embed_dim=24,
                       bin_num=10, pad_token_id=config['pad_token_id'], mask_token_id=config['mask_token_id'])
    model.encoder = pytorchTransformerModule(seq_len, 16, depth=2, heads=4)
    model.decoder = pytorchTransformerModule(seq_len, 24, depth=1, heads=4)
    model.eval()

    g = torch.Generator().manual_seed(5)
    counts = torch.poisson(torch.full((4, n_genes), 1.2), generator=g)
    counts[0, :] = torch.tensor([3., 0, 1, 0, 0, 2, 0, 0, 0, 1])   # sparse cell
    counts[2, :] = 0.0
    counts[2, 4] = 5.0                                               # one expressed gene only
    rows = []
    for c in counts:
        total = c.sum()
        norm = torch.log1p(c / total * 1e4)                          # pre_normalized == 'F'
        rows.append(torch.cat([norm, torch.tensor([4.0, math.log10(total.item())])]))   # tgthighres 't4'
    batch = torch.stack(rows)
    assert (batch[:, -1] > 0).all()

    with torch.no_grad():
        model.to_final = None                                       # 'gene_batch': gene embeddings
        (encoder_data, encoder_position_gene_ids, encoder_data_padding, encoder_labels, decoder_data,
         decoder_data_padding, _, _, decoder_position_gene_ids) = getEncoerDecoderData(batch, batch, config)
        out = model(x=encoder_data, padding_label=encoder_data_padding,
                    encoder_position_gene_ids=encoder_position_gene_ids, encoder_labels=encoder_labels,
                    decoder_data=decoder_data, mask_gene_name=False, mask_labels=None,
                    decoder_position_gene_ids=decoder_position_gene_ids,
                    decoder_data_padding_labels=decoder_data_padding)
        print("encoder rows (expressed genes):", encoder_labels.sum(1).tolist(),
              "padded to", encoder_data.shape[1])

        ok = True
        for b in range(batch.shape[0]):
            ref = ref_cell(model, batch[b], config['pad_token_id'], seq_len)
            ok &= torch.allclose(out[b], ref, atol=1e-4)
        print("batched gene embeddings match each cell run alone, unpadded:", bool(ok))
        assert ok


if __name__ == "__main__":
    main()
