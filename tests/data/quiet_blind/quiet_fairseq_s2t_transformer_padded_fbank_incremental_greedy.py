"""Correct program (quiet batch quiet-r146b).

Ported from facebookresearch/fairseq @03c196f27f68cca57377ba4cb957a76774b804b8:
fairseq/models/speech_to_text/s2t_transformer.py (Conv1dSubsampler, S2TTransformerEncoder.forward /
reorder_encoder_out, s2t_transformer_s), fairseq/data/data_utils.py (lengths_to_padding_mask),
fairseq/utils.py (make_positions), fairseq/modules/sinusoidal_positional_embedding.py,
fairseq/modules/multihead_attention.py (MultiheadAttention.forward with key_padding_mask, attn_mask, static_kv
and the incremental "prev_key"/"prev_value" state, reorder_incremental_state),
fairseq/modules/transformer_layer.py (pre-norm encoder/decoder layers),
fairseq/models/transformer/transformer_decoder.py (extract_features_scriptable, buffered_future_mask) and
fairseq/sequence_generator.py (greedy search, beam 1: finished sentences leave the batch and the encoder
output and incremental state are index_select-ed to the remaining ones), trimmed and written small.

A batch of log-mel filterbank utterances (B, T, 40), right-padded with zeros as fairseq's audio collater
pads them, goes through the 2-layer strided Conv1d subsampler; src_lengths are mapped to frame lengths
with get_out_seq_lens_tensor and encoder_padding_mask = lengths_to_padding_mask(...) (True = padded frame)
is the key padding mask of every encoder self-attention and of the decoder's cross-attention. Sinusoidal
positions are taken from the same mask (padded frames get the padding_idx row). The decoder starts from
eos, caches its self-attention keys/values step by step (no causal mask in incremental mode: the new
token's query only sees what is cached) and the encoder keys/values once (static_kv).

Conv kernels are "3,3" (Conv1dSubsampler's own default) and the frame counts are multiples of 4, so no
convolution window of a real output frame reaches past its utterance (fairseq does not zero padded frames
between the two convolutions).

Self-check (eval mode): each utterance, run alone without padding and decoded greedily by re-running the
whole prefix with the future mask (no cache), gives the same encoder frames, the same hypothesis and the
same per-step scores as the padded, cached batch.
"""
import math
from argparse import Namespace
from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

PAD, EOS, BOS, UNK = 1, 2, 0, 3


def lengths_to_padding_mask(lens):
    bsz, max_lens = lens.size(0), torch.max(lens).item()
    mask = torch.arange(max_lens).to(lens.device).view(1, max_lens)
    mask = mask.expand(bsz, -1) >= lens.view(bsz, 1).expand(-1, max_lens)
    return mask


def make_positions(tensor, padding_idx: int):
    mask = tensor.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def fill_with_neg_inf(t):
    return t.float().fill_(float("-inf")).type_as(t)


class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim, padding_idx, init_size=1024):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.register_buffer(
            "weights", self.get_embedding(init_size, embedding_dim, padding_idx), persistent=False
        )

    @staticmethod
    def get_embedding(num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        if padding_idx is not None:
            emb[padding_idx, :] = 0
        return emb

    def forward(self, input, incremental_state=None):
        bsz, seq_len = input.shape
        if incremental_state is not None:
            # positions is the same for every token when decoding a single step
            pos = self.padding_idx + seq_len
            return self.weights[pos, :].expand(bsz, 1, -1)
        positions = make_positions(input, self.padding_idx)
        return self.weights.index_select(0, positions.view(-1)).view(bsz, seq_len, -1).detach()


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, self_attention=False, encoder_decoder_attention=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.cache_key = f"attn_{id(self)}"

    def _get_input_buffer(self, incremental_state):
        return incremental_state.get(self.cache_key, {}) if incremental_state is not None else {}

    def _set_input_buffer(self, incremental_state, buffer):
        incremental_state[self.cache_key] = buffer

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        input_buffer = self._get_input_buffer(incremental_state)
        for k in list(input_buffer.keys()):
            input_buffer_k = input_buffer[k]
            if input_buffer_k is not None:
                if self.encoder_decoder_attention and input_buffer_k.size(0) == new_order.size(0):
                    break
                input_buffer[k] = input_buffer_k.index_select(0, new_order)
        if input_buffer:
            self._set_input_buffer(incremental_state, input_buffer)

    def forward(
        self,
        query,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        static_kv: bool = False,
        attn_mask: Optional[Tensor] = None,
    ):
        tgt_len, bsz, embed_dim = query.size()
        if incremental_state is not None:
            saved_state = self._get_input_buffer(incremental_state)
            if saved_state is not None and "prev_key" in saved_state:
                # previous time steps are cached - no need to recompute key and value if they are static
                if static_kv:
                    assert self.encoder_decoder_attention and not self.self_attention
                    key = value = None
        else:
            saved_state = None

        if self.self_attention:
            q = self.q_proj(query)
            k = self.k_proj(query)
            v = self.v_proj(query)
        elif self.encoder_decoder_attention:
            q = self.q_proj(query)
            if key is None:
                k = v = None
            else:
                k = self.k_proj(key)
                v = self.v_proj(key)
        q = q * self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        if k is not None:
            k = k.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        if v is not None:
            v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        if saved_state is not None:
            # saved states are stored with shape (bsz, num_heads, seq_len, head_dim)
            if "prev_key" in saved_state:
                prev_key = saved_state["prev_key"].view(bsz * self.num_heads, -1, self.head_dim)
                k = prev_key if static_kv else torch.cat([prev_key, k], dim=1)
            if "prev_value" in saved_state:
                prev_value = saved_state["prev_value"].view(bsz * self.num_heads, -1, self.head_dim)
                v = prev_value if static_kv else torch.cat([prev_value, v], dim=1)
            prev_key_padding_mask = saved_state.get("prev_key_padding_mask")
            if static_kv and prev_key_padding_mask is not None:
                key_padding_mask = prev_key_padding_mask
            saved_state["prev_key"] = k.view(bsz, self.num_heads, -1, self.head_dim)
            saved_state["prev_value"] = v.view(bsz, self.num_heads, -1, self.head_dim)
            saved_state["prev_key_padding_mask"] = key_padding_mask
            self._set_input_buffer(incremental_state, saved_state)

        src_len = k.size(1)
        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None
        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == bsz
            assert key_padding_mask.size(1) == src_len

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        assert list(attn_weights.size()) == [bsz * self.num_heads, tgt_len, src_len]

        if attn_mask is not None:
            attn_weights += attn_mask.unsqueeze(0)

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool), float("-inf")
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_probs = attn_weights_float.type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        return self.out_proj(attn)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = MultiheadAttention(
            args.encoder_embed_dim, args.encoder_attention_heads, self_attention=True
        )
        self.self_attn_layer_norm = nn.LayerNorm(args.encoder_embed_dim)
        self.fc1 = nn.Linear(args.encoder_embed_dim, args.encoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.encoder_ffn_embed_dim, args.encoder_embed_dim)
        self.final_layer_norm = nn.LayerNorm(args.encoder_embed_dim)
        self.dropout = nn.Dropout(args.dropout)

    def forward(self, x, encoder_padding_mask: Optional[Tensor]):
        residual = x
        x = self.self_attn_layer_norm(x)
        x = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask)
        x = residual + self.dropout(x)
        residual = x
        x = self.final_layer_norm(x)
        x = self.fc2(F.relu(self.fc1(x)))
        return residual + self.dropout(x)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, args):
        super().__init__()
        dim = args.decoder_embed_dim
        self.self_attn = MultiheadAttention(dim, args.decoder_attention_heads, self_attention=True)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.encoder_attn = MultiheadAttention(
            dim, args.decoder_attention_heads, encoder_decoder_attention=True
        )
        self.encoder_attn_layer_norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, args.decoder_ffn_embed_dim)
        self.fc2 = nn.Linear(args.decoder_ffn_embed_dim, dim)
        self.final_layer_norm = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(args.dropout)

    def forward(
        self,
        x,
        encoder_out: Optional[Tensor],
        encoder_padding_mask: Optional[Tensor],
        incremental_state=None,
        self_attn_mask: Optional[Tensor] = None,
        self_attn_padding_mask: Optional[Tensor] = None,
    ):
        residual = x
        x = self.self_attn_layer_norm(x)
        x = self.self_attn(
            query=x, key=x, value=x,
            key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state,
            attn_mask=self_attn_mask,
        )
        x = residual + self.dropout(x)

        residual = x
        x = self.encoder_attn_layer_norm(x)
        x = self.encoder_attn(
            query=x, key=encoder_out, value=encoder_out,
            key_padding_mask=encoder_padding_mask,
            incremental_state=incremental_state,
            static_kv=True,
        )
        x = residual + self.dropout(x)

        residual = x
        x = self.final_layer_norm(x)
        x = self.fc2(F.relu(self.fc1(x)))
        return residual + self.dropout(x)


class Conv1dSubsampler(nn.Module):
    def __init__(self, in_channels, mid_channels, out_channels, kernel_sizes: List[int] = (3, 3)):
        super().__init__()
        self.n_layers = len(kernel_sizes)
        self.conv_layers = nn.ModuleList(
            nn.Conv1d(
                in_channels if i == 0 else mid_channels // 2,
                mid_channels if i < self.n_layers - 1 else out_channels * 2,
                k,
                stride=2,
                padding=k // 2,
            )
            for i, k in enumerate(kernel_sizes)
        )

    def get_out_seq_lens_tensor(self, in_seq_lens_tensor):
        out = in_seq_lens_tensor.clone()
        for _ in range(self.n_layers):
            out = ((out.float() - 1) / 2 + 1).floor().long()
        return out

    def forward(self, src_tokens, src_lengths):
        bsz, in_seq_len, _ = src_tokens.size()  # B x T x (C x D)
        x = src_tokens.transpose(1, 2).contiguous()  # -> B x (C x D) x T
        for conv in self.conv_layers:
            x = conv(x)
            x = nn.functional.glu(x, dim=1)
        x = x.transpose(1, 2).transpose(0, 1).contiguous()  # -> T x B x (C x D)
        return x, self.get_out_seq_lens_tensor(src_lengths)


class S2TTransformerEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.dropout_module = nn.Dropout(args.dropout)
        self.embed_scale = math.sqrt(args.encoder_embed_dim)
        self.padding_idx = 1
        self.subsample = Conv1dSubsampler(
            args.input_feat_per_channel * args.input_channels,
            args.conv_channels,
            args.encoder_embed_dim,
            [int(k) for k in args.conv_kernel_sizes.split(",")],
        )
        self.embed_positions = SinusoidalPositionalEmbedding(args.encoder_embed_dim, self.padding_idx)
        self.transformer_layers = nn.ModuleList(
            [TransformerEncoderLayer(args) for _ in range(args.encoder_layers)]
        )
        self.layer_norm = nn.LayerNorm(args.encoder_embed_dim)

    def forward(self, src_tokens, src_lengths):
        x, input_lengths = self.subsample(src_tokens, src_lengths)
        x = self.embed_scale * x

        encoder_padding_mask = lengths_to_padding_mask(input_lengths)
        positions = self.embed_positions(encoder_padding_mask).transpose(0, 1)
        x += positions
        x = self.dropout_module(x)

        for layer in self.transformer_layers:
            x = layer(x, encoder_padding_mask)

        x = self.layer_norm(x)
        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask] if encoder_padding_mask.any() else [],  # B x T
        }

    def reorder_encoder_out(self, encoder_out, new_order):
        new_encoder_out = [x.index_select(1, new_order) for x in encoder_out["encoder_out"]]
        new_encoder_padding_mask = (
            [] if len(encoder_out["encoder_padding_mask"]) == 0
            else [x.index_select(0, new_order) for x in encoder_out["encoder_padding_mask"]]
        )
        return {"encoder_out": new_encoder_out, "encoder_padding_mask": new_encoder_padding_mask}


class TransformerDecoder(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.padding_idx = PAD
        self.embed_tokens = nn.Embedding(vocab_size, args.decoder_embed_dim, padding_idx=PAD)
        self.embed_scale = math.sqrt(args.decoder_embed_dim)
        self.embed_positions = SinusoidalPositionalEmbedding(args.decoder_embed_dim, PAD)
        self.layers = nn.ModuleList([TransformerDecoderLayer(args) for _ in range(args.decoder_layers)])
        self.layer_norm = nn.LayerNorm(args.decoder_embed_dim)
        self.output_projection = nn.Linear(args.decoder_embed_dim, vocab_size, bias=False)
        self.dropout_module = nn.Dropout(args.dropout)
        self._future_mask = torch.empty(0)

    def buffered_future_mask(self, tensor):
        dim = tensor.size(0)
        if self._future_mask.size(0) == 0 or self._future_mask.size(0) < dim:
            self._future_mask = torch.triu(fill_with_neg_inf(torch.zeros([dim, dim])), 1)
        self._future_mask = self._future_mask.to(tensor)
        return self._future_mask[:dim, :dim]

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None):
        enc: Optional[Tensor] = None
        padding_mask: Optional[Tensor] = None
        if encoder_out is not None and len(encoder_out["encoder_out"]) > 0:
            enc = encoder_out["encoder_out"][0]
        if encoder_out is not None and len(encoder_out["encoder_padding_mask"]) > 0:
            padding_mask = encoder_out["encoder_padding_mask"][0]

        positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]

        x = self.embed_scale * self.embed_tokens(prev_output_tokens)
        x += positions
        x = self.dropout_module(x)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C

        self_attn_padding_mask: Optional[Tensor] = None
        if prev_output_tokens.eq(self.padding_idx).any():
            self_attn_padding_mask = prev_output_tokens.eq(self.padding_idx)

        for layer in self.layers:
            if incremental_state is None:
                self_attn_mask = self.buffered_future_mask(x)
            else:
                self_attn_mask = None
            x = layer(
                x, enc, padding_mask, incremental_state,
                self_attn_mask=self_attn_mask,
                self_attn_padding_mask=self_attn_padding_mask,
            )

        x = self.layer_norm(x)
        x = x.transpose(0, 1)  # T x B x C -> B x T x C
        return self.output_projection(x)

    def reorder_incremental_state(self, incremental_state, new_order):
        for module in self.modules():
            if isinstance(module, MultiheadAttention):
                module.reorder_incremental_state(incremental_state, new_order)


class S2TTransformerModel(nn.Module):
    def __init__(self, args, vocab_size):
        super().__init__()
        self.encoder = S2TTransformerEncoder(args)
        self.decoder = TransformerDecoder(args, vocab_size)


def s2t_transformer_s_tiny():
    return Namespace(
        input_feat_per_channel=40, input_channels=1,
        conv_kernel_sizes="3,3", conv_channels=64,
        encoder_embed_dim=32, encoder_ffn_embed_dim=64, encoder_layers=2, encoder_attention_heads=4,
        decoder_embed_dim=32, decoder_ffn_embed_dim=64, decoder_layers=2, decoder_attention_heads=4,
        dropout=0.1,
    )


@torch.no_grad()
def greedy_generate(model, src_tokens, src_lengths, max_len_b=12, min_len=1):
    """SequenceGenerator._generate with beam_size=1: finished sentences leave the batch."""
    encoder_out = model.encoder(src_tokens, src_lengths)
    bsz = src_tokens.size(0)
    max_len = max_len_b
    incremental_state: Dict[str, Dict[str, Optional[Tensor]]] = {}
    tokens = torch.full((bsz, max_len + 2), PAD, dtype=torch.long)
    tokens[:, 0] = EOS
    scores = torch.zeros(bsz, max_len + 1)
    orig_idx = torch.arange(bsz)
    finalized: List[Optional[dict]] = [None] * bsz

    for step in range(max_len + 1):
        logits = model.decoder(tokens[:, : step + 1], encoder_out, incremental_state)
        lprobs = F.log_softmax(logits[:, -1, :].float(), dim=-1)
        lprobs[:, PAD] = -math.inf
        if step >= max_len:
            lprobs[:, :EOS] = -math.inf
            lprobs[:, EOS + 1:] = -math.inf
        if step < min_len:
            lprobs[:, EOS] = -math.inf
        best_scores, best_tokens = lprobs.max(dim=-1)
        tokens[:, step + 1] = best_tokens
        scores[:, step] = best_scores

        eos_rows = best_tokens.eq(EOS)
        for row in eos_rows.nonzero().view(-1).tolist():
            finalized[orig_idx[row].item()] = {
                "tokens": tokens[row, 1: step + 2].clone(),
                "positional_scores": scores[row, : step + 1].clone(),
            }
        if eos_rows.all():
            break
        if eos_rows.any():
            batch_idxs = (~eos_rows).nonzero().view(-1)
            encoder_out = model.encoder.reorder_encoder_out(encoder_out, batch_idxs)
            model.decoder.reorder_incremental_state(incremental_state, batch_idxs)
            tokens = tokens.index_select(0, batch_idxs)
            scores = scores.index_select(0, batch_idxs)
            orig_idx = orig_idx.index_select(0, batch_idxs)
    return finalized, encoder_out


@torch.no_grad()
def greedy_alone_no_cache(model, feats, max_len_b=12, min_len=1):
    """Reference: one utterance, no padding, the whole prefix re-run each step under the future mask."""
    encoder_out = model.encoder(feats[None], torch.tensor([feats.size(0)]))
    prefix = [EOS]
    out_scores = []
    for step in range(max_len_b + 1):
        logits = model.decoder(torch.tensor([prefix]), encoder_out, None)
        lprobs = F.log_softmax(logits[0, -1].float(), dim=-1)
        lprobs[PAD] = -math.inf
        if step >= max_len_b:
            keep = lprobs[EOS].clone()
            lprobs.fill_(-math.inf)
            lprobs[EOS] = keep
        if step < min_len:
            lprobs[EOS] = -math.inf
        score, tok = lprobs.max(dim=-1)
        prefix.append(tok.item())
        out_scores.append(score.item())
        if tok.item() == EOS:
            break
    return torch.tensor(prefix[1:]), torch.tensor(out_scores), encoder_out


def collate_frames(frames: List[Tensor]):
    """fairseq.data.audio.speech_to_text_dataset._collate_frames: right-pad with zeros."""
    max_len = max(f.size(0) for f in frames)
    out = frames[0].new_zeros((len(frames), max_len, frames[0].size(1)))
    for i, v in enumerate(frames):
        out[i, : v.size(0)] = v
    return out


def main():
    torch.manual_seed(18)
    vocab_size = 24
    model = S2TTransformerModel(s2t_transformer_s_tiny(), vocab_size).eval()
    with torch.no_grad():
        # stand-in for trained weights: wide enough that the hypotheses depend on the audio
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.4)

    n_frames = [48, 20, 36, 12]  # multiples of 4: no conv window of a real frame crosses an utterance's end
    utterances = [torch.randn(n, 40) for n in n_frames]
    src_tokens = collate_frames(utterances)
    src_lengths = torch.tensor(n_frames)

    with torch.no_grad():
        batch_enc = model.encoder(src_tokens, src_lengths)
    enc_lens = model.encoder.subsample.get_out_seq_lens_tensor(src_lengths)
    assert len(batch_enc["encoder_padding_mask"]) == 1
    assert torch.equal(batch_enc["encoder_padding_mask"][0].sum(1), enc_lens.max() - enc_lens)

    finalized, _ = greedy_generate(model, src_tokens, src_lengths)

    lengths_out = []
    for i, feats in enumerate(utterances):
        ref_tokens, ref_scores, ref_enc = greedy_alone_no_cache(model, feats)
        n = enc_lens[i].item()
        assert ref_enc["encoder_out"][0].size(0) == n
        torch.testing.assert_close(
            batch_enc["encoder_out"][0][:n, i], ref_enc["encoder_out"][0][:, 0], atol=1e-5, rtol=1e-5
        )
        hyp = finalized[i]
        assert torch.equal(hyp["tokens"], ref_tokens), (i, hyp["tokens"], ref_tokens)
        torch.testing.assert_close(hyp["positional_scores"], ref_scores, atol=1e-5, rtol=1e-5)
        lengths_out.append(len(ref_tokens))
        print(f"utt {i}: {n_frames[i]} fbank frames -> {n} encoder frames, hyp {hyp['tokens'].tolist()}")
    assert len(set(lengths_out)) > 2, lengths_out  # sentences leave the batch at different steps
    print("ok: padded, cached greedy batch matches each utterance decoded alone without cache")


if __name__ == "__main__":
    main()
