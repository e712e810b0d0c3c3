"""Chemformer (MolecularAI/Chemformer) BARTModel, shrunk: SMILES-to-SMILES encoder-decoder.

Ported from molbart/models/transformer_models.py (BARTModel.__init__ / forward / encode /
decode / generator / _decode_fn / sample_molecules greedy branch), molbart/models/util.py
(PreNormEncoderLayer, PreNormDecoderLayer), molbart/models/base_transformer.py
(_construct_input, _positional_embs, _generate_square_subsequent_mask),
molbart/data/util.py (BatchEncoder._pad_seqs: right padding, mask 1 = pad) and
molbart/utils/samplers/beam_search_samplers.py (greedy_decode).

Layout is sequence-first (seq_len, batch) as Chemformer keeps it; the pad masks are built
(seq_len, batch) and transposed to (batch, seq_len) for nn.MultiheadAttention.
  * encoder self-attention: src_key_padding_mask (bool, True = pad),
  * decoder self-attention: float causal tgt_mask (0 / -inf) plus bool tgt_key_padding_mask,
  * cross-attention: memory_key_padding_mask = the encoder pad mask (cloned).
In greedy decoding a finished sequence (END or PAD emitted) is fed pad tokens with pad_mask
True while the others go on (here the three stop at different steps); its pad query
rows still see the earlier real tokens, so no softmax row is empty.

The only change to the layer classes: their forward also accepts the is_causal /
tgt_is_causal / memory_is_causal keywords that recent torch's nn.TransformerEncoder /
nn.TransformerDecoder pass (unused, as in the original).

greedy_decode also sums a real_lhs (log-likelihood of non-pad steps) for the comparison.

Checks: every real position of the padded training batch against each pair run alone,
unpadded and without any key padding mask; the per-pair loss; and batched greedy decoding
(tokens and log-likelihoods) against each source decoded alone.
"""
import math
import warnings

import torch
import torch.nn as nn

warnings.filterwarnings("ignore")
torch.manual_seed(1)

PAD, BEGIN, END = 0, 1, 2


class PreNormEncoderLayer(nn.TransformerEncoderLayer):
    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        att = self.norm1(src)
        att = self.self_attn(att, att, att, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
        att = src + self.dropout1(att)
        out = self.norm2(att)
        out = self.linear2(self.dropout(self.activation(self.linear1(out))))
        out = att + self.dropout2(out)
        return out


class PreNormDecoderLayer(nn.TransformerDecoderLayer):
    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        query = self.norm1(tgt)
        query = self.self_attn(query, query, query, attn_mask=tgt_mask,
                               key_padding_mask=tgt_key_padding_mask)[0]
        query = tgt + self.dropout1(query)
        att = self.norm2(query)
        att = self.multihead_attn(att, memory, memory, attn_mask=memory_mask,
                                  key_padding_mask=memory_key_padding_mask)[0]
        att = query + self.dropout2(att)
        out = self.norm3(att)
        out = self.linear2(self.dropout(self.activation(self.linear1(out))))
        out = att + self.dropout3(out)
        return out


class BARTModel(nn.Module):
    def __init__(self, vocabulary_size=12, d_model=16, num_layers=2, num_heads=2, d_feedforward=32,
                 max_seq_len=24, dropout=0.1, activation="gelu"):
        super().__init__()
        self.d_model = d_model
        self.max_seq_len = max_seq_len
        self.emb = nn.Embedding(vocabulary_size, d_model, padding_idx=PAD)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_emb", self._positional_embs())
        self.encoder = nn.TransformerEncoder(
            PreNormEncoderLayer(d_model, num_heads, d_feedforward, dropout, activation),
            num_layers, norm=nn.LayerNorm(d_model))
        self.decoder = nn.TransformerDecoder(
            PreNormDecoderLayer(d_model, num_heads, d_feedforward, dropout, activation),
            num_layers, norm=nn.LayerNorm(d_model))
        self.loss_function = nn.CrossEntropyLoss(reduction="none", ignore_index=PAD)
        self.token_fc = nn.Linear(d_model, vocabulary_size)
        self.log_softmax = nn.LogSoftmax(dim=2)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def _construct_input(self, token_ids):
        seq_len, _ = tuple(token_ids.size())
        token_embs = self.emb(token_ids) * math.sqrt(self.d_model)
        positional_embs = self.pos_emb[:seq_len, :].unsqueeze(0).transpose(0, 1)
        return self.dropout(token_embs + positional_embs)

    def _positional_embs(self):
        encs = torch.tensor([dim / self.d_model for dim in range(0, self.d_model, 2)])
        encs = 10000 ** encs
        encs = [(torch.sin(pos / encs), torch.cos(pos / encs)) for pos in range(self.max_seq_len)]
        encs = [torch.stack(enc, dim=1).flatten()[: self.d_model] for enc in encs]
        return torch.stack(encs)

    def _generate_square_subsequent_mask(self, sz, device="cpu"):
        mask = (torch.triu(torch.ones((sz, sz), device=device)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
        return mask

    def forward(self, x):
        encoder_input = x["encoder_input"]
        decoder_input = x["decoder_input"]
        encoder_pad_mask = x["encoder_pad_mask"].transpose(0, 1)
        decoder_pad_mask = x["decoder_pad_mask"].transpose(0, 1)
        encoder_embs = self._construct_input(encoder_input)
        decoder_embeddings = self._construct_input(decoder_input)
        seq_len, _, _ = tuple(decoder_embeddings.size())
        tgt_mask = self._generate_square_subsequent_mask(seq_len, device=encoder_embs.device)
        memory = self.encoder(encoder_embs, src_key_padding_mask=encoder_pad_mask)
        model_output = self.decoder(decoder_embeddings, memory, tgt_mask=tgt_mask,
                                    tgt_key_padding_mask=decoder_pad_mask,
                                    memory_key_padding_mask=encoder_pad_mask.clone())
        return {"model_output": model_output, "token_output": self.token_fc(model_output)}

    def encode(self, batch):
        encoder_input = batch["encoder_input"]
        encoder_pad_mask = batch["encoder_pad_mask"].transpose(0, 1)
        encoder_embs = self._construct_input(encoder_input)
        return self.encoder(encoder_embs, src_key_padding_mask=encoder_pad_mask)

    def decode(self, batch):
        decoder_input = batch["decoder_input"]
        decoder_pad_mask = batch["decoder_pad_mask"].transpose(0, 1)
        memory_input = batch["memory_input"]
        memory_pad_mask = batch["memory_pad_mask"].transpose(0, 1)
        decoder_embeddings = self._construct_input(decoder_input)
        sequence_length, _, _ = tuple(decoder_embeddings.size())
        tgt_mask = self._generate_square_subsequent_mask(sequence_length, device=decoder_embeddings.device)
        decoder_output = self.decoder(decoder_embeddings, memory_input,
                                      tgt_key_padding_mask=decoder_pad_mask,
                                      memory_key_padding_mask=memory_pad_mask, tgt_mask=tgt_mask)
        return self.generator(decoder_output)

    def generator(self, decoder_output):
        return self.log_softmax(self.token_fc(decoder_output))

    def _calc_mask_loss(self, token_output, target, target_mask):
        seq_len, batch_size, _ = tuple(token_output.size())
        token_pred = token_output.reshape((seq_len * batch_size, -1)).float()
        loss = self.loss_function(token_pred, target.reshape(-1)).reshape((seq_len, batch_size))
        inv_target_mask = ~(target_mask > 0)
        num_tokens = inv_target_mask.sum()
        loss = loss * inv_target_mask
        return loss.sum() / num_tokens

    def _decode_fn(self, token_ids, pad_mask, memory, mem_pad_mask):
        return self.decode({"decoder_input": token_ids, "decoder_pad_mask": pad_mask,
                            "memory_input": memory, "memory_pad_mask": mem_pad_mask})

    @torch.no_grad()
    def sample_greedy(self, batch_input, max_seq_len):
        enc_input = batch_input["encoder_input"]
        enc_mask = batch_input["encoder_pad_mask"]
        memory = self.encode({"encoder_input": enc_input, "encoder_pad_mask": enc_mask})
        mem_mask = enc_mask.clone()
        _, batch_size, _ = tuple(memory.size())
        return greedy_decode(lambda t, p: self._decode_fn(t, p, memory, mem_mask), batch_size, max_seq_len)


def greedy_decode(decode_fn, batch_size, max_seq_len):
    token_ids = [BEGIN] + ([PAD] * (max_seq_len - 1))
    token_ids = torch.tensor([token_ids] * batch_size).transpose(0, 1)
    pad_mask = torch.zeros((max_seq_len, batch_size), dtype=torch.bool)
    log_lhs = torch.zeros((batch_size))
    real_lhs = torch.zeros((batch_size))  # added for the check: log-likelihood of real tokens only
    for i in range(1, max_seq_len):
        token_ids_seq = token_ids[:i, :]
        pad_mask_seq = pad_mask[:i, :]
        output_dist = decode_fn(token_ids_seq, pad_mask_seq)
        probs, output_ids = output_dist.max(dim=2)
        new_ids = output_ids[-1, :]
        new_probs = probs[-1, :]
        is_end_token = token_ids[i - 1, :] == END
        is_pad_token = token_ids[i - 1, :] == PAD
        new_pad_mask = torch.logical_or(is_end_token, is_pad_token)
        if new_pad_mask.sum().item() == new_pad_mask.numel():
            break
        if i == max_seq_len - 1:
            new_ids[~new_pad_mask] = END
        new_ids[new_pad_mask] = PAD
        token_ids[i, :] = new_ids
        pad_mask[i, :] = new_pad_mask
        log_lhs += new_probs
        real_lhs += new_probs * (~new_pad_mask)
    return token_ids.transpose(0, 1), real_lhs


def pad_seqs(seqs, pad_token):
    """BatchEncoder._pad_seqs: right padding, mask 1 = padded."""
    pad_length = max([len(seq) for seq in seqs])
    padded = [seq + ([pad_token] * (pad_length - len(seq))) for seq in seqs]
    masks = [([0] * len(seq)) + ([1] * (pad_length - len(seq))) for seq in seqs]
    return torch.tensor(padded).transpose(0, 1), torch.tensor(masks, dtype=torch.bool).transpose(0, 1)


def main():
    model = BARTModel().eval()
    g = torch.Generator().manual_seed(1)
    src = [[BEGIN] + torch.randint(3, 12, (n,), generator=g).tolist() + [END] for n in (6, 2, 4)]
    tgt = [[BEGIN] + torch.randint(3, 12, (n,), generator=g).tolist() + [END] for n in (3, 7, 5)]

    enc_ids, enc_mask = pad_seqs(src, PAD)
    dec_ids, dec_mask = pad_seqs(tgt, PAD)
    batch = {"encoder_input": enc_ids, "encoder_pad_mask": enc_mask,
             "decoder_input": dec_ids[:-1], "decoder_pad_mask": dec_mask[:-1]}
    with torch.no_grad():
        out = model(batch)["token_output"]                    # (tgt_len, batch, vocab)
        worst, loss_worst = 0.0, 0.0
        for b, (s, t) in enumerate(zip(src, tgt)):
            s_ids = torch.tensor(s).unsqueeze(1)
            t_ids = torch.tensor(t).unsqueeze(1)
            alone = model({"encoder_input": s_ids, "encoder_pad_mask": torch.zeros_like(s_ids, dtype=torch.bool),
                           "decoder_input": t_ids[:-1],
                           "decoder_pad_mask": torch.zeros_like(t_ids[:-1], dtype=torch.bool)})["token_output"]
            n = len(t) - 1
            worst = max(worst, (out[:n, b] - alone[:, 0]).abs().max().item())
            l_b = model._calc_mask_loss(out[:n, b:b + 1], t_ids[1:], dec_mask[1:n + 1, b:b + 1])
            l_a = model._calc_mask_loss(alone, t_ids[1:], torch.zeros_like(t_ids[1:], dtype=torch.bool))
            loss_worst = max(loss_worst, abs(l_b.item() - l_a.item()))
        train_ok = worst < 1e-5 and loss_worst < 1e-5
        print("teacher-forced logits, padded batch vs each pair alone: max diff %.2e, loss diff %.2e, match: %s"
              % (worst, loss_worst, train_ok))

        max_len = 9
        toks, lls = model.sample_greedy({"encoder_input": enc_ids, "encoder_pad_mask": enc_mask}, max_len)
        dec_ok = True
        for b, s in enumerate(src):
            s_ids = torch.tensor(s).unsqueeze(1)
            t1, l1 = model.sample_greedy({"encoder_input": s_ids,
                                          "encoder_pad_mask": torch.zeros_like(s_ids, dtype=torch.bool)}, max_len)
            same = torch.equal(t1[0], toks[b]) and abs(l1[0].item() - lls[b].item()) < 1e-4
            print("greedy source %d: batched %s | alone %s | same: %s"
                  % (b, toks[b].tolist(), t1[0].tolist(), same))
            dec_ok = dec_ok and same

    ok = train_ok and dec_ok
    print("MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
