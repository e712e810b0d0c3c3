# Citation: lucidrains/alphafold2 commit 3042daa ("protect against edge case where MSA row is made of
# padding"; diff and parent read).
# Upstream: alphafold2_pytorch/embeds.py MSAEmbedWrapper.forward -> utils.get_msa_embedd /
# ids_to_embed_input -> the ESM MSA Transformer (esm/axial_attention.py RowSelfAttention, tied row
# attention; esm/model/msa_transformer.py MSATransformer.forward, padding_mask = tokens.eq(padding_idx)).
# Bug: the wrapper stacks the query sequence on the MSA and sends the whole padded batch to the MSA
# Transformer, ignoring msa_mask. MSA rows that are all padding (sidechainnet pad id 20, '_') become strings
# of '_' that the ESM alphabet encodes as <unk>, not <pad>, so the MSA Transformer's own padding mask does
# not cover them: a shallow MSA's padding rows take part in its tied row attention (logits summed over rows)
# and in column attention, and change the embeddings handed to Alphafold2.
# Fix: with msa_mask given, count each element's MSA rows (msa_mask.any(-1).sum(-1)), embed each element on
# its own with only that many rows of seq_and_msa, zero-pad the embeddings back to the batch depth, and
# pass msa_mask on to Alphafold2.
# The ESM MSA Transformer is shrunk (2 layers, dim 32, random weights instead of torch.hub weights) and the
# Alphafold2 trunk is a small stand-in that reads seq_embed / msa_embed / msa_mask.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


class RowSelfAttention(nn.Module):
    """Compute self-attention over rows of a 2D input."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, max_tokens_per_msa: int = 2 ** 16):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.max_tokens_per_msa = max_tokens_per_msa
        self.attn_shape = "hnij"

        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def align_scaling(self, q):
        num_rows = q.size(0)
        return self.scaling / math.sqrt(num_rows)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        scaling = self.align_scaling(x)
        attn_weights = self.compute_attention_weights(x, scaling, self_attn_mask, self_attn_padding_mask)
        attn_probs = attn_weights.softmax(-1)
        attn_probs = self.dropout_module(attn_probs)
        output = self.compute_attention_update(x, attn_probs)
        return output, attn_probs

    def compute_attention_weights(self, x, scaling, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        q = self.q_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        q *= scaling
        if self_attn_padding_mask is not None:
            # Zero out any padded aligned positions - this is important since
            # we take a sum across the alignment axis.
            q *= 1 - self_attn_padding_mask.permute(1, 2, 0).unsqueeze(3).unsqueeze(4).to(q)

        attn_weights = torch.einsum(f"rinhd,rjnhd->{self.attn_shape}", q, k)

        if self_attn_mask is not None:
            raise NotImplementedError
            # Mask Size: [B x R x C], Weights Size: [H x B x C x C]

        if self_attn_padding_mask is not None:
            attn_weights = attn_weights.masked_fill(
                self_attn_padding_mask[:, 0].unsqueeze(0).unsqueeze(2),
                -10000,
            )

        return attn_weights

    def compute_attention_update(self, x, attn_probs):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        v = self.v_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
        context = torch.einsum(f"{self.attn_shape},rjnhd->rinhd", attn_probs, v)
        context = context.contiguous().view(num_rows, num_cols, batch_size, embed_dim)
        output = self.out_proj(context)
        return output


class ColumnSelfAttention(nn.Module):
    """Compute self-attention over columns of a 2D input."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, max_tokens_per_msa: int = 2 ** 16):
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.max_tokens_per_msa = max_tokens_per_msa

        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.dropout_module = nn.Dropout(dropout)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        return self.compute_attention_update(x, self_attn_mask, self_attn_padding_mask)

    def compute_attention_update(self, x, self_attn_mask=None, self_attn_padding_mask=None):
        num_rows, num_cols, batch_size, embed_dim = x.size()
        if num_rows == 1:
            attn_probs = torch.ones(
                self.num_heads, num_cols, batch_size, num_rows, num_rows, device=x.device, dtype=x.dtype
            )
            output = self.out_proj(self.v_proj(x))
        else:
            q = self.q_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
            k = self.k_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
            v = self.v_proj(x).view(num_rows, num_cols, batch_size, self.num_heads, self.head_dim)
            q *= self.scaling

            attn_weights = torch.einsum("icnhd,jcnhd->hcnij", q, k)

            if self_attn_mask is not None:
                raise NotImplementedError
            if self_attn_padding_mask is not None:
                attn_weights = attn_weights.masked_fill(
                    self_attn_padding_mask.permute(2, 0, 1).unsqueeze(0).unsqueeze(3),
                    -10000,
                )

            attn_probs = attn_weights.softmax(-1)
            attn_probs = self.dropout_module(attn_probs)
            context = torch.einsum("hcnij,jcnhd->icnhd", attn_probs, v)
            context = context.contiguous().view(num_rows, num_cols, batch_size, embed_dim)
            output = self.out_proj(context)
        return output, attn_probs


class FeedForwardNetwork(nn.Module):
    def __init__(self, embedding_dim, ffn_embedding_dim, activation_dropout=0.1):
        super().__init__()
        self.activation_fn = nn.GELU()
        self.activation_dropout_module = nn.Dropout(activation_dropout)
        self.fc1 = nn.Linear(embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, embedding_dim)

    def forward(self, x):
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        return x


class NormalizedResidualBlock(nn.Module):
    def __init__(self, layer, embedding_dim, dropout=0.1):
        super().__init__()
        self.layer = layer
        self.dropout_module = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(embedding_dim)

    def forward(self, x, *args, **kwargs):
        residual = x
        x = self.layer_norm(x)
        outputs = self.layer(x, *args, **kwargs)
        if isinstance(outputs, tuple):
            x, *out = outputs
        else:
            x = outputs
            out = None
        x = self.dropout_module(x)
        x = residual + x
        if out is not None:
            return (x,) + tuple(out)
        return x


class AxialTransformerLayer(nn.Module):
    """Implements an Axial MSA Transformer block."""

    def __init__(self, embedding_dim, ffn_embedding_dim, num_attention_heads, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, max_tokens_per_msa=2 ** 14):
        super().__init__()
        row_self_attention = RowSelfAttention(embedding_dim, num_attention_heads, dropout=dropout,
                                              max_tokens_per_msa=max_tokens_per_msa)
        column_self_attention = ColumnSelfAttention(embedding_dim, num_attention_heads, dropout=dropout,
                                                    max_tokens_per_msa=max_tokens_per_msa)
        feed_forward_layer = FeedForwardNetwork(embedding_dim, ffn_embedding_dim,
                                                activation_dropout=activation_dropout)
        self.row_self_attention = NormalizedResidualBlock(row_self_attention, embedding_dim, dropout)
        self.column_self_attention = NormalizedResidualBlock(column_self_attention, embedding_dim, dropout)
        self.feed_forward_layer = NormalizedResidualBlock(feed_forward_layer, embedding_dim, dropout)

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None, need_head_weights=False):
        x, row_attn = self.row_self_attention(x, self_attn_mask=self_attn_mask,
                                              self_attn_padding_mask=self_attn_padding_mask)
        x, column_attn = self.column_self_attention(x, self_attn_mask=self_attn_mask,
                                                    self_attn_padding_mask=self_attn_padding_mask)
        x = self.feed_forward_layer(x)
        if need_head_weights:
            return x, column_attn, row_attn
        return x


class LearnedPositionalEmbedding(nn.Embedding):
    def __init__(self, num_embeddings, embedding_dim, padding_idx):
        if padding_idx is not None:
            num_embeddings_ = num_embeddings + padding_idx + 1
        else:
            num_embeddings_ = num_embeddings
        super().__init__(num_embeddings_, embedding_dim, padding_idx)
        self.max_positions = num_embeddings

    def forward(self, input):
        mask = input.ne(self.padding_idx).int()
        positions = (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + self.padding_idx
        return F.embedding(positions, self.weight, self.padding_idx)


class MSATransformer(nn.Module):
    def __init__(self, alphabet_size=33, padding_idx=1, mask_idx=32, cls_idx=0, eos_idx=2,
                 embed_dim=32, layers=2, attention_heads=4, ffn_embed_dim=64, max_positions=64):
        super().__init__()
        self.padding_idx = padding_idx
        self.embed_tokens = nn.Embedding(alphabet_size, embed_dim, padding_idx=padding_idx)
        self.msa_position_embedding = nn.Parameter(0.01 * torch.randn(1, 1024, 1, 1), requires_grad=True)
        self.dropout_module = nn.Dropout(0.0)
        self.layers = nn.ModuleList(
            [AxialTransformerLayer(embed_dim, ffn_embed_dim, attention_heads) for _ in range(layers)]
        )
        self.embed_positions = LearnedPositionalEmbedding(max_positions, embed_dim, padding_idx)
        self.emb_layer_norm_before = nn.LayerNorm(embed_dim)
        self.emb_layer_norm_after = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, alphabet_size)

    def forward(self, tokens, repr_layers=[], return_contacts=False):
        assert tokens.ndim == 3
        batch_size, num_alignments, seqlen = tokens.size()
        padding_mask = tokens.eq(self.padding_idx)  # B, R, C
        if not padding_mask.any():
            padding_mask = None

        x = self.embed_tokens(tokens)
        x += self.embed_positions(tokens.view(batch_size * num_alignments, seqlen)).view(x.size())
        x += self.msa_position_embedding[:, :num_alignments]

        x = self.emb_layer_norm_before(x)
        x = self.dropout_module(x)

        if padding_mask is not None:
            x = x * (1 - padding_mask.unsqueeze(-1).type_as(x))

        # B x R x C x D -> R x C x B x D
        repr_layers = set(repr_layers)
        hidden_representations = {}
        if 0 in repr_layers:
            hidden_representations[0] = x

        x = x.permute(1, 2, 0, 3)
        for layer_idx, layer in enumerate(self.layers):
            x = layer(x, self_attn_padding_mask=padding_mask)
            if (layer_idx + 1) in repr_layers:
                hidden_representations[layer_idx + 1] = x.permute(2, 0, 1, 3)

        x = self.emb_layer_norm_after(x)
        x = x.permute(2, 0, 1, 3)  # R x C x B x D -> B x R x C x D
        # last hidden representation should have layer norm applied
        if (layer_idx + 1) in repr_layers:
            hidden_representations[layer_idx + 1] = x
        x = self.lm_head(x)
        return {"logits": x, "representations": hidden_representations}


# ---- ESM "MSA 1" alphabet and MSABatchConverter (esm/data.py) ----

class Alphabet:
    def __init__(self):
        self.prepend_toks = ("<cls>", "<pad>", "<eos>", "<unk>")
        self.standard_toks = list("LAGVSERTIDPKQNFYMHWCXBUZO.-")
        self.append_toks = ("<mask>",)
        self.prepend_bos, self.append_eos, self.use_msa = True, False, True
        self.all_toks = list(self.prepend_toks) + self.standard_toks
        for i in range((8 - (len(self.all_toks) % 8)) % 8):
            self.all_toks.append(f"<null_{i + 1}>")
        self.all_toks.extend(self.append_toks)
        self.tok_to_idx = {tok: i for i, tok in enumerate(self.all_toks)}
        self.unk_idx = self.tok_to_idx["<unk>"]
        self.padding_idx = self.get_idx("<pad>")
        self.cls_idx = self.get_idx("<cls>")
        self.mask_idx = self.get_idx("<mask>")
        self.eos_idx = self.get_idx("<eos>")

    def get_idx(self, tok):
        return self.tok_to_idx.get(tok, self.unk_idx)

    def encode(self, text):
        return [self.get_idx(tok) for tok in list(text)]

    def get_batch_converter(self):
        return MSABatchConverter(self)


class BatchConverter:
    def __init__(self, alphabet):
        self.alphabet = alphabet

    def __call__(self, raw_batch):
        batch_size = len(raw_batch)
        batch_labels, seq_str_list = zip(*raw_batch)
        seq_encoded_list = [self.alphabet.encode(seq_str) for seq_str in seq_str_list]
        max_len = max(len(seq_encoded) for seq_encoded in seq_encoded_list)
        tokens = torch.full((batch_size, max_len + int(self.alphabet.prepend_bos) + int(self.alphabet.append_eos)),
                            self.alphabet.padding_idx, dtype=torch.int64)
        for i, seq_encoded in enumerate(seq_encoded_list):
            if self.alphabet.prepend_bos:
                tokens[i, 0] = self.alphabet.cls_idx
            seq = torch.tensor(seq_encoded, dtype=torch.int64)
            tokens[i, int(self.alphabet.prepend_bos): len(seq_encoded) + int(self.alphabet.prepend_bos)] = seq
        return batch_labels, seq_str_list, tokens


class MSABatchConverter(BatchConverter):
    def __call__(self, inputs):
        if isinstance(inputs[0][0], str):
            raw_batch = [inputs]
        else:
            raw_batch = inputs
        batch_size = len(raw_batch)
        max_alignments = max(len(msa) for msa in raw_batch)
        max_seqlen = max(len(msa[0][1]) for msa in raw_batch)
        tokens = torch.full((batch_size, max_alignments, max_seqlen + int(self.alphabet.prepend_bos)),
                            self.alphabet.padding_idx, dtype=torch.int64)
        labels, strs = [], []
        for i, msa in enumerate(raw_batch):
            msa_labels, msa_strs, msa_tokens = super().__call__(msa)
            labels.append(msa_labels)
            strs.append(msa_strs)
            tokens[i, : msa_tokens.size(0), : msa_tokens.size(1)] = msa_tokens
        return labels, strs, tokens


# ---- alphafold2_pytorch/utils.py ----

class ProteinVocabulary:
    """sidechainnet's vocabulary: 20 amino acids, pad '_' = 20."""

    def __init__(self):
        self._int2char = {i: c for i, c in enumerate("ARNDCEQGHILKMFPSTWYV")}
        self._int2char[20] = "_"


VOCAB = ProteinVocabulary()


def ids_to_embed_input(x):
    """ Returns the amino acid string input for calculating the ESM and MSA transformer embeddings """
    assert isinstance(x, list), 'input must be a list'
    id2aa = VOCAB._int2char
    out = []
    for el in x:
        if isinstance(el, list):
            out.append(ids_to_embed_input(el))
        elif isinstance(el, int):
            out.append(id2aa[el])
        else:
            raise TypeError('type must be either list or character')
    if all(map(lambda c: isinstance(c, str), out)):
        return (None, ''.join(out))
    return out


REPR_LAYER_NUM = 2  # 12 in esm_msa1_t12_100M_UR50S


def get_msa_embedd(msa, embedd_model, batch_converter, device=None):
    """ Returns the MSA_tr embeddings for a protein: (batch, n_seqs, L, embedd_dim) """
    max_seq_len = msa.shape[-1]
    embedd_inputs = ids_to_embed_input(msa.tolist())
    msa_batch_labels, msa_batch_strs, msa_batch_tokens = batch_converter(embedd_inputs)
    with torch.no_grad():
        results = embedd_model(msa_batch_tokens.to(device), repr_layers=[REPR_LAYER_NUM], return_contacts=False)
    # index 0 is for start token. so take from 1 one
    token_reps = results["representations"][REPR_LAYER_NUM][..., 1:, :]
    return token_reps


# ---- stand-in for the Alphafold2 trunk: consumes seq_embed / msa_embed / msa_mask ----

class Alphafold2(nn.Module):
    def __init__(self, dim=16, buckets=8):
        super().__init__()
        self.dim = dim
        self.to_pair = nn.Linear(dim, dim)
        self.to_distogram_logits = nn.Linear(dim, buckets)

    def forward(self, seq, msa, seq_embed=None, msa_embed=None, msa_mask=None, **kwargs):
        if exists(msa_mask):
            m = msa_embed.masked_fill(~msa_mask.unsqueeze(-1), 0.)
            pooled = m.sum(dim=1) / msa_mask.sum(dim=1).clamp(min=1).unsqueeze(-1)
        else:
            pooled = msa_embed.mean(dim=1)
        x = seq_embed + pooled
        pairwise = self.to_pair(x).unsqueeze(2) + self.to_pair(x).unsqueeze(1)
        return self.to_distogram_logits(pairwise)


# ---- alphafold2_pytorch/embeds.py ----

MSA_EMBED_DIM = 32


class MSAEmbedWrapper(nn.Module):
    def __init__(self, *, alphafold2):
        super().__init__()
        self.alphafold2 = alphafold2
        alphabet = Alphabet()
        model = MSATransformer(alphabet_size=len(alphabet.all_toks), padding_idx=alphabet.padding_idx,
                               mask_idx=alphabet.mask_idx, cls_idx=alphabet.cls_idx, eos_idx=alphabet.eos_idx,
                               embed_dim=MSA_EMBED_DIM).eval()
        batch_converter = alphabet.get_batch_converter()
        self.model = model
        self.batch_converter = batch_converter
        self.project_embed = nn.Linear(MSA_EMBED_DIM, alphafold2.dim) if MSA_EMBED_DIM != alphafold2.dim else nn.Identity()

    def forward(self, seq, msa, msa_mask=None, **kwargs):
        assert seq.shape[-1] == msa.shape[-1], 'sequence and msa must have the same length if you wish to use MSA transformer embeddings'
        model, batch_converter, device = self.model, self.batch_converter, seq.device

        seq_and_msa = torch.cat((seq.unsqueeze(1), msa), dim=1)

        if FIXED and exists(msa_mask):
            # in the event that there are rows in the MSA that are completely padding
            # process each batch element individually, so that padding isn't processed
            # with row-tied attention
            num_msa = msa_mask.any(dim=-1).sum(dim=-1).tolist()
            seq_and_msa_list = seq_and_msa.unbind(dim=0)
            num_rows = seq_and_msa.shape[1]

            embeds = []
            for num, batch_el in zip(num_msa, seq_and_msa_list):
                batch_el = batch_el.unsqueeze(0)  # rearrange(batch_el, '... -> () ...')
                batch_el = batch_el[:, :num]
                embed = get_msa_embedd(batch_el, model, batch_converter, device=device)
                embed = F.pad(embed, (0, 0, 0, 0, 0, num_rows - num), value=0.)
                embeds.append(embed)

            embeds = torch.cat(embeds, dim=0)
        else:
            embeds = get_msa_embedd(seq_and_msa, model, batch_converter, device=device)

        embeds = self.project_embed(embeds)
        seq_embed, msa_embed = embeds[:, 0], embeds[:, 1:]

        return self.alphafold2(seq, msa, seq_embed=seq_embed, msa_embed=msa_embed, msa_mask=msa_mask, **kwargs)


# ---- a batch of two proteins of length 8: one with 4 MSA rows, one with 2 MSA rows padded to 4 ----

b, m, n = 2, 4, 8
g = torch.Generator().manual_seed(3)
seq = torch.randint(0, 20, (b, n), generator=g)
msa = torch.randint(0, 20, (b, m, n), generator=g)
msa_mask = torch.ones(b, m, n, dtype=torch.bool)
msa[1, 2:] = 20           # sidechainnet pad id
msa_mask[1, 2:] = False
mask = torch.ones(b, n, dtype=torch.bool)

wrapper = MSAEmbedWrapper(alphafold2=Alphafold2()).eval()
with torch.no_grad():
    distogram_logits = wrapper(seq, msa, msa_mask=msa_mask, mask=mask)
    probs = distogram_logits.softmax(-1)

print("distogram logits shape:", tuple(distogram_logits.shape))
print("protein 1, pair (0, 5) logits:", [round(v, 4) for v in distogram_logits[1, 0, 5].tolist()])
print("protein 0, pair (0, 5) logits:", [round(v, 4) for v in distogram_logits[0, 0, 5].tolist()])
print(f"mean expected bucket per protein: {[round(v, 4) for v in (probs * torch.arange(8.)).sum(-1).mean(dim=(1, 2)).tolist()]}")
