# Correct program (quiet batch quiet-r72a).
# Citation: k2-fsa/icefall @1b45d37080c69576c5aaa60a2a48fe269584d187:
#   egs/librispeech/ASR/conformer_ctc/transformer.py (Transformer.run_encoder, decoder_forward, decoder_nll,
#   TransformerEncoderLayer / TransformerDecoderLayer with normalize_before, PositionalEncoding,
#   encoder_padding_mask, decoder_padding_mask, generate_square_subsequent_mask, add_sos, add_eos) and
#   conformer_ctc/subsampling.py (Conv2dSubsampling); the n-best expansion of icefall/decode.py
#   (rescore_with_attention_decoder: memory.index_select(1, path_to_utt_map) and the same for
#   memory_key_padding_mask) written small. Plain transformer encoder in place of the conformer.
# A speech recognizer's attention decoder used for n-best rescoring: a batch of three utterances of 31, 15
# and 23 fbank frames (lhotse supervisions: sequence_idx, start_frame, num_frames) right-padded; the encoder
# mask is built from the supervisions at the subsampled rate (True = a padded frame, src_key_padding_mask of
# nn.MultiheadAttention, sequence first); each utterance's hypotheses (2, 1 and 3 of them, different lengths)
# are padded with eos (ys_in) / -1 (ys_out); the decoder takes the square subsequent mask, a key padding
# mask from ys_in == eos with column 0 (sos == eos) unmasked, and memory_key_padding_mask.
# Self-check: decoder_nll of every real hypothesis token, and decoder_forward's loss, equal each utterance
# encoded alone (no supervisions, no mask) and each hypothesis decoded alone (a one-row batch, causal mask
# only).
import math
import sys
from typing import List

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

torch.manual_seed(0)


class Conv2dSubsampling(nn.Module):
    """Convolutional 2D subsampling (to 1/4 length): ((T - 1) // 2 - 1) // 2 output frames."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels=1, out_channels=odim, kernel_size=3, stride=2),
            nn.ReLU(),
            nn.Conv2d(in_channels=odim, out_channels=odim, kernel_size=3, stride=2),
            nn.ReLU(),
        )
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On entry, x is (N, T, idim)
        x = x.unsqueeze(1)  # (N, T, idim) -> (N, 1, T, idim) i.e., (N, C, H, W)
        x = self.conv(x)
        # Now x is of shape (N, odim, ((T-1)//2 - 1)//2, ((idim-1)//2 - 1)//2)
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        return x


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        self.dropout = nn.Dropout(p=dropout)
        self.pe = torch.zeros(1, 0, self.d_model, dtype=torch.float32)

    def extend_pe(self, x: torch.Tensor) -> None:
        if self.pe is not None:
            if self.pe.size(1) >= x.size(1):
                self.pe = self.pe.to(dtype=x.dtype, device=x.device)
                return
        pe = torch.zeros(x.size(1), self.d_model, dtype=torch.float32)
        position = torch.arange(0, x.size(1), dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / self.d_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0).to(device=x.device, dtype=x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.extend_pe(x)
        x = x * self.xscale + self.pe[:, : x.size(1), :]
        return self.dropout(x)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, normalize_before=True):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = nn.functional.relu
        self.normalize_before = normalize_before

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        residual = src
        if self.normalize_before:
            src = self.norm1(src)
        src2 = self.self_attn(src, src, src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)[0]
        src = residual + self.dropout1(src2)
        if not self.normalize_before:
            src = self.norm1(src)
        residual = src
        if self.normalize_before:
            src = self.norm2(src)
        src2 = self.linear2(self.dropout(self.activation(self.linear1(src))))
        src = residual + self.dropout2(src2)
        if not self.normalize_before:
            src = self.norm2(src)
        return src


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, normalize_before=True):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.src_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.activation = nn.functional.relu
        self.normalize_before = normalize_before

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        tgt2 = self.self_attn(tgt, tgt, tgt, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        tgt = residual + self.dropout1(tgt2)
        if not self.normalize_before:
            tgt = self.norm1(tgt)
        residual = tgt
        if self.normalize_before:
            tgt = self.norm2(tgt)
        tgt2 = self.src_attn(tgt, memory, memory, attn_mask=memory_mask,
                             key_padding_mask=memory_key_padding_mask)[0]
        tgt = residual + self.dropout2(tgt2)
        if not self.normalize_before:
            tgt = self.norm2(tgt)
        residual = tgt
        if self.normalize_before:
            tgt = self.norm3(tgt)
        tgt2 = self.linear2(self.dropout(self.activation(self.linear1(tgt))))
        tgt = residual + self.dropout3(tgt2)
        if not self.normalize_before:
            tgt = self.norm3(tgt)
        return tgt


def encoder_padding_mask(max_len, supervisions=None):
    if supervisions is None:
        return None
    supervision_segments = torch.stack(
        (supervisions["sequence_idx"], supervisions["start_frame"], supervisions["num_frames"]), 1
    ).to(torch.int32)
    lengths = [0 for _ in range(int(supervision_segments[:, 0].max().item()) + 1)]
    for idx in range(supervision_segments.size(0)):
        sequence_idx = supervision_segments[idx, 0].item()
        start_frame = supervision_segments[idx, 1].item()
        num_frames = supervision_segments[idx, 2].item()
        lengths[sequence_idx] = start_frame + num_frames
    lengths = [((i - 1) // 2 - 1) // 2 for i in lengths]
    bs = int(len(lengths))
    seq_range = torch.arange(0, max_len, dtype=torch.int64)
    seq_range_expand = seq_range.unsqueeze(0).expand(bs, max_len)
    seq_length_expand = torch.tensor(lengths, dtype=seq_range_expand.dtype).unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return mask


def decoder_padding_mask(ys_pad, ignore_id=-1):
    ys_mask = ys_pad == ignore_id
    return ys_mask


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
    return mask


def add_sos(token_ids, sos_id):
    return [[sos_id] + utt for utt in token_ids]


def add_eos(token_ids, eos_id):
    return [utt + [eos_id] for utt in token_ids]


class Transformer(nn.Module):
    def __init__(self, num_features, num_classes, d_model=32, nhead=4, dim_feedforward=64,
                 num_encoder_layers=2, num_decoder_layers=2, dropout=0.1, normalize_before=True):
        super().__init__()
        self.num_features = num_features
        self.num_classes = num_classes
        self.encoder_embed = Conv2dSubsampling(num_features, d_model)
        self.encoder_pos = PositionalEncoding(d_model, dropout)
        encoder_layer = TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout, normalize_before)
        self.encoder = nn.TransformerEncoder(
            encoder_layer=encoder_layer, num_layers=num_encoder_layers,
            norm=nn.LayerNorm(d_model) if normalize_before else None, enable_nested_tensor=False,
        )
        self.encoder_output_layer = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(d_model, num_classes))
        self.decoder_num_class = self.num_classes
        self.decoder_embed = nn.Embedding(num_embeddings=self.decoder_num_class, embedding_dim=d_model)
        self.decoder_pos = PositionalEncoding(d_model, dropout)
        decoder_layer = TransformerDecoderLayer(d_model, nhead, dim_feedforward, dropout, normalize_before)
        self.decoder = nn.TransformerDecoder(
            decoder_layer=decoder_layer, num_layers=num_decoder_layers,
            norm=nn.LayerNorm(d_model) if normalize_before else None,
        )
        self.decoder_output_layer = torch.nn.Linear(d_model, self.decoder_num_class)

    def run_encoder(self, x, supervisions=None):
        x = self.encoder_embed(x)
        x = self.encoder_pos(x)
        x = x.permute(1, 0, 2)  # (N, T, C) -> (T, N, C)
        mask = encoder_padding_mask(x.size(0), supervisions)
        mask = mask.to(x.device) if mask is not None else None
        x = self.encoder(x, src_key_padding_mask=mask)  # (T, N, C)
        return x, mask

    def _decode(self, memory, memory_key_padding_mask, token_ids, sos_id, eos_id):
        ys_in = add_sos(token_ids, sos_id=sos_id)
        ys_in = [torch.tensor(y) for y in ys_in]
        ys_in_pad = pad_sequence(ys_in, batch_first=True, padding_value=float(eos_id))
        ys_out = add_eos(token_ids, eos_id=eos_id)
        ys_out = [torch.tensor(y) for y in ys_out]
        ys_out_pad = pad_sequence(ys_out, batch_first=True, padding_value=float(-1))
        device = memory.device
        ys_in_pad = ys_in_pad.to(device, dtype=torch.int64)
        ys_out_pad = ys_out_pad.to(device, dtype=torch.int64)
        tgt_mask = generate_square_subsequent_mask(ys_in_pad.shape[-1]).to(device)
        tgt_key_padding_mask = decoder_padding_mask(ys_in_pad, ignore_id=eos_id)
        # We set the first column to False since the first column in ys_in_pad
        # contains sos_id, which is the same as eos_id in our current setting.
        tgt_key_padding_mask[:, 0] = False
        tgt = self.decoder_embed(ys_in_pad)  # (B, T) -> (B, T, F)
        tgt = self.decoder_pos(tgt)
        tgt = tgt.permute(1, 0, 2)  # (B, T, F) -> (T, B, F)
        pred_pad = self.decoder(
            tgt=tgt,
            memory=memory,
            tgt_mask=tgt_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
        )  # (T, B, F)
        pred_pad = pred_pad.permute(1, 0, 2)  # (T, B, F) -> (B, T, F)
        pred_pad = self.decoder_output_layer(pred_pad)  # (B, T, F)
        return pred_pad, ys_out_pad

    def decoder_forward(self, memory, memory_key_padding_mask, token_ids, sos_id, eos_id):
        # the training loss (icefall uses LabelSmoothingLoss; plain summed cross entropy here)
        pred_pad, ys_out_pad = self._decode(memory, memory_key_padding_mask, token_ids, sos_id, eos_id)
        return torch.nn.functional.cross_entropy(
            pred_pad.reshape(-1, self.decoder_num_class), ys_out_pad.reshape(-1), ignore_index=-1,
            reduction="sum",
        )

    def decoder_nll(self, memory, memory_key_padding_mask, token_ids, sos_id, eos_id):
        pred_pad, ys_out_pad = self._decode(memory, memory_key_padding_mask, token_ids, sos_id, eos_id)
        nll = torch.nn.functional.cross_entropy(
            pred_pad.view(-1, self.decoder_num_class), ys_out_pad.view(-1), ignore_index=-1, reduction="none"
        )
        return nll.view(pred_pad.shape[0], -1)


NUM_FEATURES = 16
VOCAB = 30
SOS = EOS = VOCAB - 1
model = Transformer(NUM_FEATURES, VOCAB).eval()
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.3)

num_frames = [31, 15, 23]
feats = [torch.randn(n, NUM_FEATURES) for n in num_frames]
features = pad_sequence(feats, batch_first=True, padding_value=0.0)  # (N, T, C), right padded
supervisions = {
    "sequence_idx": torch.tensor([0, 1, 2]),
    "start_frame": torch.tensor([0, 0, 0]),
    "num_frames": torch.tensor(num_frames),
}
transcripts = [[3, 7, 12, 5], [8, 4], [11, 22, 6]]
# n-best hypotheses per utterance (rescore_with_attention_decoder), flattened with path_to_utt_map
nbest = [[[3, 7, 12, 5], [3, 7, 5]], [[8, 4, 9, 9, 10, 2]], [[11, 22, 6], [11, 6], [14, 22, 6, 6, 1]]]
token_ids: List[List[int]] = [h for hyps in nbest for h in hyps]
path_to_utt_map = torch.tensor([u for u, hyps in enumerate(nbest) for _ in hyps])

with torch.no_grad():
    memory, memory_key_padding_mask = model.run_encoder(features, supervisions)
    train_loss = model.decoder_forward(memory, memory_key_padding_mask, transcripts, SOS, EOS)
    expanded_memory = memory.index_select(1, path_to_utt_map)
    expanded_memory_key_padding_mask = memory_key_padding_mask.index_select(0, path_to_utt_map)
    nll = model.decoder_nll(expanded_memory, expanded_memory_key_padding_mask, token_ids, SOS, EOS)
    tot_scores = -nll.sum(dim=1)

# ---- reference: every utterance encoded alone, every hypothesis decoded alone, no padding anywhere ----
ok = True
assert (~memory_key_padding_mask).sum(1).tolist() == [((n - 1) // 2 - 1) // 2 for n in num_frames]
ref_train = 0.0
alone_memory = []
for u, f in enumerate(feats):
    with torch.no_grad():
        mem_u, m = model.run_encoder(f[None], None)
        assert m is None
        L = mem_u.size(0)
        d_mem = (memory[:L, u] - mem_u[:, 0]).abs().max().item()
        ok &= d_mem < 1e-4
        alone_memory.append(mem_u)
        ref_train += model.decoder_forward(mem_u, None, [transcripts[u]], SOS, EOS)
    print(f"utt {u}: {num_frames[u]} frames -> {L} encoder frames, max|dmemory|={d_mem:.2e}")
d_train = (train_loss - ref_train).abs().item()
print(f"decoder_forward loss batch={train_loss.item():.5f} ref={float(ref_train):.5f} |d|={d_train:.2e}")
ok &= d_train < 1e-3

for i, hyp in enumerate(token_ids):
    u = path_to_utt_map[i].item()
    with torch.no_grad():
        nll_alone = model.decoder_nll(alone_memory[u], None, [hyp], SOS, EOS)[0]
    n = len(hyp) + 1
    d = (nll[i, :n] - nll_alone).abs().max().item()
    zero_tail = bool((nll[i, n:] == 0).all())
    print(f"hyp {i} (utt {u}, {len(hyp)} tokens): score batch={tot_scores[i].item():.4f} "
          f"alone={-nll_alone.sum().item():.4f} max|dnll|={d:.2e}")
    ok &= d < 1e-4 and zero_tail

if not ok:
    print("MISMATCH")
    sys.exit(1)
print("OK")
