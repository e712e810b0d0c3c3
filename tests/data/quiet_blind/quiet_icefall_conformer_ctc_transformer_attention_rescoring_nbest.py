# Citation: k2-fsa/icefall egs/librispeech/ASR/conformer_ctc/transformer.py @1b45d37080c69576c5aaa60a2a48fe269584d187
#   (Transformer.forward / run_encoder / ctc_output / decoder_nll, TransformerEncoderLayer, TransformerDecoderLayer,
#   PositionalEncoding, encoder_padding_mask, decoder_padding_mask, generate_square_subsequent_mask, add_sos, add_eos),
#   subsampling.py Conv2dSubsampling (conv 3x3 stride 2, twice, no padding: T' = ((T-1)//2 - 1)//2), and
#   icefall/decode.py rescore_with_attention_decoder (memory / memory_key_padding_mask index_select'ed per n-best path).
# A CTC/attention hybrid: the encoder's key padding mask comes from the lhotse supervisions (start_frame + num_frames,
# taken through the subsampling formula); the attention decoder scores n-best paths of uneven length, padded with
# eos (== sos), with a float causal mask plus a key padding mask `ys_in_pad == eos_id` whose first (sos) column is
# cleared. Targets are padded with -1 and ignored by the cross entropy. Sequence-first nn.MultiheadAttention throughout.
# The layers' extra `is_causal` / `tgt_is_causal` / `memory_is_causal` arguments (unused) only let torch 2.x's
# nn.TransformerEncoder / nn.TransformerDecoder call them; enable_nested_tensor=False only silences torch's warning.
# Conv2dSubsampling is the plain conv-relu-conv-relu-linear of icefall's master subsampling.py.
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn
from torch.nn.utils.rnn import pad_sequence

Supervisions = Dict[str, torch.Tensor]
LOG_EPSILON = math.log(1e-10)  # lhotse pads fbank features with this value


class Conv2dSubsampling(nn.Module):
    def __init__(self, idim: int, odim: int) -> None:
        assert idim >= 7
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels=1, out_channels=odim, kernel_size=3, stride=2),
            nn.ReLU(),
            nn.Conv2d(in_channels=odim, out_channels=odim, kernel_size=3, stride=2),
            nn.ReLU(),
        )
        self.out = nn.Linear(odim * (((idim - 1) // 2 - 1) // 2), odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(1)  # (N, T, idim) -> (N, 1, T, idim)
        x = self.conv(x)
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        return x


class Transformer(nn.Module):
    def __init__(
        self,
        num_features: int,
        num_classes: int,
        subsampling_factor: int = 4,
        d_model: int = 256,
        nhead: int = 4,
        dim_feedforward: int = 2048,
        num_encoder_layers: int = 12,
        num_decoder_layers: int = 6,
        dropout: float = 0.1,
        normalize_before: bool = True,
        use_feat_batchnorm: Union[float, bool] = 0.1,
    ) -> None:
        super().__init__()
        self.use_feat_batchnorm = use_feat_batchnorm
        if isinstance(use_feat_batchnorm, bool) and use_feat_batchnorm:
            self.feat_batchnorm = nn.BatchNorm1d(num_features)
        self.num_features = num_features
        self.num_classes = num_classes
        self.subsampling_factor = subsampling_factor
        if subsampling_factor != 4:
            raise NotImplementedError("Support only 'subsampling_factor=4'.")
        self.encoder_embed = Conv2dSubsampling(num_features, d_model)
        self.encoder_pos = PositionalEncoding(d_model, dropout)
        encoder_layer = TransformerEncoderLayer(
            d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward,
            dropout=dropout, normalize_before=normalize_before,
        )
        encoder_norm = nn.LayerNorm(d_model) if normalize_before else None
        self.encoder = nn.TransformerEncoder(
            encoder_layer=encoder_layer, num_layers=num_encoder_layers, norm=encoder_norm,
            enable_nested_tensor=False,
        )
        self.encoder_output_layer = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(d_model, num_classes))

        self.decoder_num_class = self.num_classes  # bpe model already has sos/eos symbol
        self.decoder_embed = nn.Embedding(num_embeddings=self.decoder_num_class, embedding_dim=d_model)
        self.decoder_pos = PositionalEncoding(d_model, dropout)
        decoder_layer = TransformerDecoderLayer(
            d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward,
            dropout=dropout, normalize_before=normalize_before,
        )
        decoder_norm = nn.LayerNorm(d_model) if normalize_before else None
        self.decoder = nn.TransformerDecoder(
            decoder_layer=decoder_layer, num_layers=num_decoder_layers, norm=decoder_norm,
        )
        self.decoder_output_layer = torch.nn.Linear(d_model, self.decoder_num_class)

    def forward(self, x: torch.Tensor, supervision: Optional[Supervisions] = None):
        if isinstance(self.use_feat_batchnorm, bool) and self.use_feat_batchnorm:
            x = x.permute(0, 2, 1)
            x = self.feat_batchnorm(x)
            x = x.permute(0, 2, 1)
        if isinstance(self.use_feat_batchnorm, float):
            x *= self.use_feat_batchnorm
        encoder_memory, memory_key_padding_mask = self.run_encoder(x, supervision)
        x = self.ctc_output(encoder_memory)
        return x, encoder_memory, memory_key_padding_mask

    def run_encoder(self, x: torch.Tensor, supervisions: Optional[Supervisions] = None):
        x = self.encoder_embed(x)
        x = self.encoder_pos(x)
        x = x.permute(1, 0, 2)  # (N, T, C) -> (T, N, C)
        mask = encoder_padding_mask(x.size(0), supervisions)
        mask = mask.to(x.device) if mask is not None else None
        x = self.encoder(x, src_key_padding_mask=mask)  # (T, N, C)
        return x, mask

    def ctc_output(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder_output_layer(x)
        x = x.permute(1, 0, 2)  # (T, N, C) ->(N, T, C)
        x = nn.functional.log_softmax(x, dim=-1)  # (N, T, C)
        return x

    def decoder_nll(
        self,
        memory: torch.Tensor,
        memory_key_padding_mask: torch.Tensor,
        token_ids: List[List[int]],
        sos_id: int,
        eos_id: int,
    ) -> torch.Tensor:
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
        nll = torch.nn.functional.cross_entropy(
            pred_pad.view(-1, self.decoder_num_class),
            ys_out_pad.view(-1),
            ignore_index=-1,
            reduction="none",
        )
        nll = nll.view(pred_pad.shape[0], -1)
        return nll


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", normalize_before=True):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=0.0)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _get_activation_fn(activation)
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
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", normalize_before=True):
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
        self.activation = _get_activation_fn(activation)
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
        tgt2 = self.src_attn(tgt, memory, memory, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask)[0]
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


def _get_activation_fn(activation: str):
    if activation == "relu":
        return nn.functional.relu
    elif activation == "gelu":
        return nn.functional.gelu
    raise RuntimeError("activation should be relu/gelu, not {}".format(activation))


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
        pe = pe.unsqueeze(0)
        self.pe = pe.to(device=x.device, dtype=x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.extend_pe(x)
        x = x * self.xscale + self.pe[:, : x.size(1), :]
        return self.dropout(x)


def encoder_padding_mask(max_len: int, supervisions: Optional[Supervisions] = None) -> Optional[torch.Tensor]:
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
    seq_length_expand = torch.tensor(lengths, device=seq_range_expand.device,
                                     dtype=seq_range_expand.dtype).unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return mask


def decoder_padding_mask(ys_pad: torch.Tensor, ignore_id: int = -1) -> torch.Tensor:
    ys_mask = ys_pad == ignore_id
    return ys_mask


def generate_square_subsequent_mask(sz: int) -> torch.Tensor:
    mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
    return mask


def add_sos(token_ids: List[List[int]], sos_id: int) -> List[List[int]]:
    return [[sos_id] + utt for utt in token_ids]


def add_eos(token_ids: List[List[int]], eos_id: int) -> List[List[int]]:
    return [utt + [eos_id] for utt in token_ids]


def rescore_with_attention_decoder(model, memory, memory_key_padding_mask, path_to_utt_map, token_ids, sos_id, eos_id):
    """icefall/decode.py: each n-best path gets its utterance's memory and padding mask, then decoder_nll."""
    expanded_memory = memory.index_select(1, path_to_utt_map)
    if memory_key_padding_mask is not None:
        expanded_memory_key_padding_mask = memory_key_padding_mask.index_select(0, path_to_utt_map)
    else:
        expanded_memory_key_padding_mask = None
    nll = model.decoder_nll(
        memory=expanded_memory,
        memory_key_padding_mask=expanded_memory_key_padding_mask,
        token_ids=token_ids,
        sos_id=sos_id,
        eos_id=eos_id,
    )
    assert nll.ndim == 2
    assert nll.shape[0] == len(token_ids)
    attention_scores = -nll.sum(dim=1)
    return nll, attention_scores


def main():
    torch.manual_seed(0)
    num_features, num_classes = 23, 12
    sos_id = eos_id = num_classes - 1  # bpe: <sos/eos> is the last id; blank is 0
    model = Transformer(
        num_features=num_features, num_classes=num_classes, d_model=32, nhead=4, dim_feedforward=64,
        num_encoder_layers=2, num_decoder_layers=2, dropout=0.1, normalize_before=True, use_feat_batchnorm=0.1,
    ).eval()

    num_frames = [61, 45, 30]
    feats = [torch.randn(n, num_features) for n in num_frames]
    feature = pad_sequence(feats, batch_first=True, padding_value=LOG_EPSILON)  # (N, T, C), right padded
    supervisions = {
        "sequence_idx": torch.arange(len(feats), dtype=torch.int32),
        "start_frame": torch.zeros(len(feats), dtype=torch.int32),
        "num_frames": torch.tensor(num_frames, dtype=torch.int32),
    }

    # n-best paths per utterance, uneven lengths, tokens 1..num_classes-2 (never blank, never sos/eos)
    g = torch.Generator().manual_seed(1)
    path_to_utt = [0, 0, 0, 1, 1, 2, 2, 2]
    path_lens = [5, 2, 7, 3, 6, 1, 4, 8]
    token_ids = [torch.randint(1, num_classes - 1, (n,), generator=g).tolist() for n in path_lens]
    path_to_utt_map = torch.tensor(path_to_utt, dtype=torch.int64)

    with torch.no_grad():
        nnet_output, memory, memory_key_padding_mask = model(feature.clone(), supervisions)
        nll, attention_scores = rescore_with_attention_decoder(
            model, memory, memory_key_padding_mask, path_to_utt_map, token_ids, sos_id, eos_id)

        # reference: each utterance alone (no padding), each path scored alone
        for i, f in enumerate(feats):
            sup_i = {
                "sequence_idx": torch.zeros(1, dtype=torch.int32),
                "start_frame": torch.zeros(1, dtype=torch.int32),
                "num_frames": torch.tensor([num_frames[i]], dtype=torch.int32),
            }
            out_i, mem_i, mask_i = model(f.unsqueeze(0).clone(), sup_i)
            t_i = ((num_frames[i] - 1) // 2 - 1) // 2
            assert out_i.shape[1] == t_i and not mask_i.any()
            assert int((~memory_key_padding_mask[i]).sum()) == t_i
            torch.testing.assert_close(nnet_output[i, :t_i], out_i[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(memory[:t_i, i], mem_i[:, 0], atol=1e-5, rtol=1e-5)
            # CTC greedy best path over the valid frames is the same
            best = nnet_output[i, :t_i].argmax(-1)
            assert torch.equal(best, out_i[0].argmax(-1))
            for p in range(len(token_ids)):
                if path_to_utt[p] != i:
                    continue
                nll_p = model.decoder_nll(mem_i, mask_i, [token_ids[p]], sos_id, eos_id)
                n = len(token_ids[p]) + 1
                torch.testing.assert_close(nll[p, :n], nll_p[0], atol=1e-5, rtol=1e-5)
                assert torch.all(nll[p, n:] == 0)
                torch.testing.assert_close(attention_scores[p], -nll_p.sum(), atol=1e-5, rtol=1e-5)
    print("ok: batched CTC outputs and n-best attention rescoring match per-utterance runs")


if __name__ == "__main__":
    main()
