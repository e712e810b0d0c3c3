# RUCAIBox/TextBox commit c9fe8cb ("FIX: comments and bugs", 2021-01-04), textbox/model/Seq2Seq/transformerencdec.py.
# TransformerEncDec trains its decoder with `self_attn_mask = self.self_attn_mask(len)` (a triu causal mask), but
# since commit 6daf156 its generate() re-ran the decoder over the whole prefix generated so far (no cache) and called
# `self.decoder(decoder_input, external_states=..., external_padding_mask=...)` with no `self_attn_mask`: at every
# step each prefix position attended to the later prefix tokens in every decoder layer, which the last position then
# reads in the next layer. c9fe8cb builds `self_attn_mask` for the prefix length at each step and passes it to the
# decoder. Ported from the files at 468a2be (the generate loop between 6daf156 and 73acb23, top-k/top-p sampling);
# --fixed adds the two lines c9fe8cb adds to that loop.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---- textbox/module/Attention/attention_mechanism.py ------------------------------------------------------------
class MultiHeadAttention(torch.nn.Module):
    def __init__(self, embedding_size, num_heads, attn_weight_dropout_ratio=0.0):
        super(MultiHeadAttention, self).__init__()
        self.embedding_size = embedding_size
        self.num_heads = num_heads
        self.head_size = embedding_size // num_heads

        assert self.head_size * num_heads == self.embedding_size, "embedding size must be divisible by num_heads"

        self.scaling = self.head_size ** -0.5  # d_k ** -0.5

        self.query_proj = nn.Linear(embedding_size, embedding_size)
        self.key_proj = nn.Linear(embedding_size, embedding_size)
        self.value_proj = nn.Linear(embedding_size, embedding_size)

        self.out_proj = nn.Linear(embedding_size, embedding_size)

        self.weight_dropout = nn.Dropout(attn_weight_dropout_ratio)

        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.query_proj.weight, std=0.02)
        nn.init.normal_(self.key_proj.weight, std=0.02)
        nn.init.normal_(self.value_proj.weight, std=0.02)
        nn.init.normal_(self.out_proj.weight, std=0.02)
        nn.init.constant_(self.query_proj.bias, 0.)
        nn.init.constant_(self.key_proj.bias, 0.)
        nn.init.constant_(self.value_proj.bias, 0.)
        nn.init.constant_(self.out_proj.bias, 0.)

    def forward(self, query, key, value, key_padding_mask=None, attn_mask=None):
        batch_size, tgt_len, embedding_size = query.size()
        src_len = key.size(1)
        assert key.size() == value.size()

        q = self.query_proj(query) * self.scaling
        k = self.key_proj(key)
        v = self.value_proj(value)

        q = q.view(batch_size, tgt_len, self.num_heads, self.head_size).permute(0, 2, 1, 3)
        k = k.view(batch_size, src_len, self.num_heads, self.head_size).permute(0, 2, 3, 1)
        v = v.view(batch_size, src_len, self.num_heads, self.head_size).permute(0, 2, 1, 3)

        attn_weights = torch.matmul(q, k)
        assert list(attn_weights.size()) == [batch_size, self.num_heads, tgt_len, src_len]

        if attn_mask is not None:
            attn_weights.masked_fill_(
                attn_mask.unsqueeze(0).unsqueeze(1),
                float('-inf')
            )

        if key_padding_mask is not None:
            attn_weights.masked_fill_(
                key_padding_mask.unsqueeze(1).unsqueeze(2),
                float('-inf')
            )

        attn_weights = self.weight_dropout(F.softmax(attn_weights, dim=-1))
        attn_repre = torch.matmul(attn_weights, v)

        assert list(attn_repre.size()) == [batch_size, self.num_heads, tgt_len, self.head_size]

        attn_repre = attn_repre.transpose(1, 2).contiguous().view(batch_size, tgt_len, embedding_size)
        attn_repre = self.out_proj(attn_repre)

        # maximum attention weight over heads
        attn_weights, _ = attn_weights.max(dim=1)

        return attn_repre, attn_weights


class SelfAttentionMask(torch.nn.Module):
    def __init__(self, init_size=100):
        super(SelfAttentionMask, self).__init__()
        self.weights = SelfAttentionMask.get_mask(init_size)

    @staticmethod
    def get_mask(size):
        weights = torch.ones((size, size), dtype=torch.uint8).triu_(1)  # above the diagonal == 1
        return weights

    def forward(self, size):
        if self.weights is None or size > self.weights.size(0):
            self.weights = SelfAttentionMask.get_mask(size)
        masks = self.weights[:size, :size].detach()
        return masks


# ---- textbox/module/layers.py -------------------------------------------------------------------------------------
class TransformerLayer(torch.nn.Module):
    def __init__(self, embedding_size, ffn_size, num_heads, attn_dropout_ratio=0.0, attn_weight_dropout_ratio=0.0,
                 ffn_dropout_ratio=0.0, with_external=False):
        super(TransformerLayer, self).__init__()
        self.multi_head_attention = MultiHeadAttention(embedding_size, num_heads, attn_weight_dropout_ratio)
        self.feed_forward_1 = nn.Linear(embedding_size, ffn_size)
        self.feed_forward_2 = nn.Linear(ffn_size, embedding_size)

        self.attn_layer_norm = nn.LayerNorm(embedding_size, eps=1e-6)
        self.ffn_layer_norm = nn.LayerNorm(embedding_size, eps=1e-6)

        self.attn_dropout = nn.Dropout(attn_dropout_ratio)
        self.ffn_dropout = nn.Dropout(ffn_dropout_ratio)

        self.with_external = with_external

        if self.with_external:
            self.external_multi_head_attention = MultiHeadAttention(embedding_size, num_heads, attn_weight_dropout_ratio)
            self.external_layer_norm = nn.LayerNorm(embedding_size)

        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.feed_forward_1.weight, std=0.02)
        nn.init.normal_(self.feed_forward_2.weight, std=0.02)
        nn.init.constant_(self.feed_forward_1.bias, 0.)
        nn.init.constant_(self.feed_forward_2.bias, 0.)

    def gelu(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))

    def forward(self, x, kv=None,
                self_padding_mask=None, self_attn_mask=None,
                external_states=None, external_padding_mask=None):
        residual = x
        if kv is None:
            x, self_attn_weights = self.multi_head_attention(query=x, key=x, value=x,
                                                             key_padding_mask=self_padding_mask,
                                                             attn_mask=self_attn_mask)
        else:
            x, self_attn_weights = self.multi_head_attention(query=x, key=kv, value=kv,
                                                             key_padding_mask=self_padding_mask,
                                                             attn_mask=self_attn_mask)
        x = self.attn_dropout(x)
        x = self.attn_layer_norm(residual + x)

        if self.with_external:
            residual = x
            x, external_attn_weights = self.external_multi_head_attention(query=x,
                                                                          key=external_states,
                                                                          value=external_states,
                                                                          key_padding_mask=external_padding_mask)
            x = self.attn_dropout(x)
            x = self.external_layer_norm(residual + x)
        else:
            external_attn_weights = None

        residual = x
        x = self.feed_forward_2(self.gelu(self.feed_forward_1(x)))
        x = self.ffn_dropout(x)
        x = self.ffn_layer_norm(residual + x)

        return x, self_attn_weights, external_attn_weights


# ---- textbox/module/Encoder/transformer_encoder.py, textbox/module/Decoder/transformer_decoder.py --------------
class TransformerEncoder(torch.nn.Module):
    def __init__(self, embedding_size, ffn_size, num_enc_layers, num_heads, attn_dropout_ratio=0.0,
                 attn_weight_dropout_ratio=0.0, ffn_dropout_ratio=0.0):
        super(TransformerEncoder, self).__init__()

        self.transformer_layers = nn.ModuleList()
        for _ in range(num_enc_layers):
            self.transformer_layers.append(
                TransformerLayer(embedding_size, ffn_size, num_heads, attn_dropout_ratio, attn_weight_dropout_ratio,
                                 ffn_dropout_ratio))

    def forward(self, x, kv=None, self_padding_mask=None, output_all_encoded_layers=False):
        all_encoded_layers = []
        for idx, layer in enumerate(self.transformer_layers):
            x, _, _ = layer(x, kv, self_padding_mask)
            all_encoded_layers.append(x)
        if output_all_encoded_layers:
            return all_encoded_layers
        return all_encoded_layers[-1]


class TransformerDecoder(torch.nn.Module):
    def __init__(self, embedding_size, ffn_size, num_dec_layers, num_heads, attn_dropout_ratio=0.0,
                 attn_weight_dropout_ratio=0.0, ffn_dropout_ratio=0.0, with_external=True):
        super(TransformerDecoder, self).__init__()

        self.transformer_layers = nn.ModuleList()
        for _ in range(num_dec_layers):
            self.transformer_layers.append(
                TransformerLayer(embedding_size, ffn_size, num_heads, attn_dropout_ratio, attn_weight_dropout_ratio,
                                 ffn_dropout_ratio, with_external))

    def forward(self, x, kv=None,
                self_padding_mask=None, self_attn_mask=None,
                external_states=None, external_padding_mask=None):
        for idx, layer in enumerate(self.transformer_layers):
            x, _, _ = layer(x, kv, self_padding_mask, self_attn_mask, external_states, external_padding_mask)
        return x


# ---- textbox/module/Embedder/position_embedder.py ----------------------------------------------------------------
class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, embedding_size, max_length=512):
        super(SinusoidalPositionalEmbedding, self).__init__()
        self.embedding_size = embedding_size
        self.weights = SinusoidalPositionalEmbedding.get_embedding(max_length, embedding_size)

    @staticmethod
    def get_embedding(max_length, embedding_size):
        half_dim = embedding_size // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(max_length, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(max_length, -1)
        if embedding_size % 2 == 1:
            # zero pad
            emb = torch.cat([emb, torch.zeros(max_length, 1)], dim=1)
        return emb

    def forward(self, input_seq, offset=0):
        batch_size, seq_len = input_seq.size()
        max_position = seq_len + offset
        if self.weights is None or max_position > self.weights.size(0):
            # recompute/expand embeddings if needed
            self.weights = SinusoidalPositionalEmbedding.get_embedding(max_position, self.embedding_size)

        positions = offset + torch.arange(seq_len)
        pos_embeddings = self.weights.index_select(0, positions).unsqueeze(0).expand(batch_size, -1, -1).detach()
        return pos_embeddings


# ---- textbox/module/strategy.py -----------------------------------------------------------------------------------
def topk_sampling(logits, temperature=1.0, top_k=0, top_p=0.9):
    logits = logits / temperature
    top_k = min(top_k, logits.size(-1))  # Safety check

    if top_k > 0:
        values = torch.topk(logits, top_k)[0]  # B x top_k
        batch_mins = values[:, :, -1].expand_as(logits.squeeze(1)).unsqueeze(1)
        logits = torch.where(logits < batch_mins, torch.ones_like(logits) * -1e10, logits)

    if 0.0 < top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)
        sorted_probs, _ = torch.sort(probs, descending=True, dim=-1)

        cumprobs = sorted_probs.cumsum(dim=-1)

        # Create mask for all cumulative probabilities less than p
        mask = cumprobs < top_p

        # First mask must always be pickable
        mask = F.pad(mask[:, :, :-1], (1, 0, 0, 0), value=1)

        masked_probs = torch.where(mask, sorted_probs, torch.tensor(float('inf')).to(probs))

        batch_mins = masked_probs.min(dim=-1, keepdim=True)[0].expand_as(logits)

        # Mask out all logits (tail) that are too small
        logits = torch.where(probs < batch_mins, torch.tensor(float('-inf')).to(logits), logits)

    probabilities = F.softmax(logits, dim=-1)
    probabilities = probabilities.squeeze(1)
    token_idx = torch.multinomial(probabilities, 1)

    return token_idx


# ---- textbox/model/abstract_generator.py (ConditionalGenerator, trimmed) -----------------------------------------
class ConditionalGenerator(nn.Module):
    def __init__(self, config, dataset):
        super(ConditionalGenerator, self).__init__()
        self.device = config['device']
        self.source_vocab_size = dataset.source_vocab_size
        self.target_vocab_size = dataset.target_vocab_size


# ---- textbox/model/Seq2Seq/transformerencdec.py -------------------------------------------------------------------
class TransformerEncDec(ConditionalGenerator):
    r"""Transformer-based Encoder-Decoder architecture is a powerful framework for conditional text generation.
    """

    def __init__(self, config, dataset):
        super(TransformerEncDec, self).__init__(config, dataset)

        # load parameters info
        self.embedding_size = config['embedding_size']
        self.ffn_size = config['ffn_size']
        self.num_heads = config['num_heads']
        self.num_enc_layers = config['num_enc_layers']
        self.num_dec_layers = config['num_dec_layers']
        self.attn_dropout_ratio = config['attn_dropout_ratio']
        self.attn_weight_dropout_ratio = config['attn_weight_dropout_ratio']
        self.ffn_dropout_ratio = config['ffn_dropout_ratio']

        self.padding_token_idx = dataset.padding_token_idx
        self.sos_token_idx = dataset.sos_token_idx
        self.eos_token_idx = dataset.eos_token_idx

        # define layers and loss
        self.source_token_embedder = nn.Embedding(self.source_vocab_size, self.embedding_size,
                                                  padding_idx=self.padding_token_idx)

        if config['share_vocab']:
            self.target_token_embedder = self.source_token_embedder
        else:
            self.target_token_embedder = nn.Embedding(self.target_vocab_size, self.embedding_size,
                                                      padding_idx=self.padding_token_idx)

        self.position_embedder = SinusoidalPositionalEmbedding(self.embedding_size)

        self.self_attn_mask = SelfAttentionMask()

        self.encoder = TransformerEncoder(self.embedding_size, self.ffn_size, self.num_enc_layers, self.num_heads,
                                          self.attn_dropout_ratio, self.attn_weight_dropout_ratio,
                                          self.ffn_dropout_ratio)

        self.decoder = TransformerDecoder(self.embedding_size, self.ffn_size, self.num_dec_layers, self.num_heads,
                                          self.attn_dropout_ratio, self.attn_weight_dropout_ratio,
                                          self.ffn_dropout_ratio, with_external=True)

        self.vocab_linear = nn.Linear(self.embedding_size, self.target_vocab_size)

        self.loss = nn.CrossEntropyLoss(ignore_index=self.padding_token_idx, reduction='none')
        self.max_target_length = config['target_max_seq_length']

        # parameters initialization
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.vocab_linear.weight, std=0.02)
        nn.init.constant_(self.vocab_linear.bias, 0.)

    def generate(self, eval_dataloader):
        generate_corpus = []
        idx2token = eval_dataloader.target_idx2token

        with torch.no_grad():
            for batch_data in eval_dataloader:
                source_text = batch_data['source_idx']
                source_embeddings = self.source_token_embedder(source_text) + \
                                    self.position_embedder(source_text).to(self.device)
                source_padding_mask = torch.eq(source_text, self.padding_token_idx).to(self.device)
                encoder_outputs = self.encoder(source_embeddings,
                                               self_padding_mask=source_padding_mask,
                                               output_all_encoded_layers=False)

                for bid in range(source_text.size(0)):
                    generate_tokens = []
                    prev_token_ids = [self.sos_token_idx]
                    for gen_idx in range(self.max_target_length):
                        input_seq = torch.LongTensor([prev_token_ids]).to(self.device)
                        decoder_input = self.target_token_embedder(input_seq) + \
                                        self.position_embedder(input_seq).to(self.device)
                        if FIXED:
                            self_attn_mask = self.self_attn_mask(input_seq.size(-1)).bool().to(self.device)
                            decoder_outputs = self.decoder(decoder_input, self_attn_mask=self_attn_mask,
                                                           external_states=encoder_outputs[bid, :, :].unsqueeze(0),
                                                           external_padding_mask=source_padding_mask[bid, :].unsqueeze(0))
                        else:
                            decoder_outputs = self.decoder(decoder_input,
                                                           external_states=encoder_outputs[bid, :, :].unsqueeze(0),
                                                           external_padding_mask=source_padding_mask[bid, :].unsqueeze(0))

                        token_logits = self.vocab_linear(decoder_outputs[:, -1, :].unsqueeze(1))
                        token_idx = topk_sampling(token_logits)
                        token_idx = token_idx.item()
                        if token_idx == self.eos_token_idx:
                            break
                        else:
                            generate_tokens.append(idx2token[token_idx])
                            prev_token_ids.append(token_idx)
                    generate_corpus.append(generate_tokens)
        return generate_corpus

    def calculate_loss(self, corpus, epoch_idx=0):
        source_text = corpus['source_idx']

        input_text = corpus['target_idx'][:, :-1]
        target_text = corpus['target_idx'][:, 1:]

        source_embeddings = self.source_token_embedder(source_text) + self.position_embedder(source_text).to(
            self.device)
        source_padding_mask = torch.eq(source_text, self.padding_token_idx).to(self.device)
        encoder_outputs = self.encoder(source_embeddings,
                                       self_padding_mask=source_padding_mask)

        input_embeddings = self.target_token_embedder(input_text) + self.position_embedder(input_text).to(self.device)
        self_padding_mask = torch.eq(input_text, self.padding_token_idx).to(self.device)
        self_attn_mask = self.self_attn_mask(input_text.size(-1)).bool().to(self.device)
        decoder_outputs = self.decoder(input_embeddings,
                                       self_padding_mask=self_padding_mask,
                                       self_attn_mask=self_attn_mask,
                                       external_states=encoder_outputs,
                                       external_padding_mask=source_padding_mask)

        token_logits = self.vocab_linear(decoder_outputs)
        loss = self.loss(token_logits.view(-1, token_logits.size(-1)), target_text.contiguous().view(-1))
        loss = loss.reshape_as(target_text)

        length = corpus['target_length'] - 1
        loss = loss.sum(dim=1) / length

        return loss.mean()


# ---- a tiny paired-sentence dataset and run (TextBox: pad 0, unk 1, sos 2, eos 3; right-padded batches) -----------
class PairedSentDataset:
    padding_token_idx, unknown_token_idx, sos_token_idx, eos_token_idx = 0, 1, 2, 3
    source_vocab_size = 24
    target_vocab_size = 24


class EvalDataLoader:
    def __init__(self, batches, target_idx2token):
        self.batches = batches
        self.target_idx2token = target_idx2token

    def __iter__(self):
        return iter(self.batches)


def right_pad(seqs, pad):
    n = max(len(s) for s in seqs)
    return torch.tensor([s + [pad] * (n - len(s)) for s in seqs])


def main():
    config = {
        'device': torch.device('cpu'), 'embedding_size': 32, 'ffn_size': 64, 'num_heads': 4,
        'num_enc_layers': 2, 'num_dec_layers': 2, 'attn_dropout_ratio': 0.1, 'attn_weight_dropout_ratio': 0.1,
        'ffn_dropout_ratio': 0.1, 'share_vocab': False, 'target_max_seq_length': 8,
    }
    dataset = PairedSentDataset()
    torch.manual_seed(0)
    model = TransformerEncDec(config, dataset)
    # stands in for a trained checkpoint: the released init (std 0.02) gives near-uniform attention
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and 'embedder' not in name:
                p.normal_(0.0, 0.7)
    model.eval()

    sources = [[5, 9, 14, 7, 11, 3], [6, 12, 3], [19, 4, 8, 21, 3], [13, 3]]
    targets = [[2, 8, 13, 10, 3], [2, 17, 9, 3], [2, 5, 3], [2, 20, 6, 7, 3]]
    corpus = {
        'source_idx': right_pad(sources, 0),
        'target_idx': right_pad(targets, 0),
        'target_length': torch.tensor([len(t) for t in targets], dtype=torch.float),
    }
    with torch.no_grad():
        print('teacher-forced loss: %.4f' % model.calculate_loss(corpus).item())

    idx2token = {i: 'tok%d' % i for i in range(dataset.target_vocab_size)}
    eval_dataloader = EvalDataLoader([{'source_idx': right_pad(sources, 0)}], idx2token)
    torch.manual_seed(1234)
    corpus_out = model.generate(eval_dataloader)
    for i, toks in enumerate(corpus_out):
        print('sample %d: %s' % (i, ' '.join(toks)))


if __name__ == '__main__':
    main()
