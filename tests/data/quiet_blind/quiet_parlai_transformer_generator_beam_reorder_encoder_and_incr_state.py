# Citation: facebookresearch/ParlAI @a29567f7ce76992fd1f03c51ba9e3b155a37ea51:
#   parlai/agents/transformer/modules/attention.py (MultiHeadAttention.forward with incr_state / static_kv,
#   reorder_incremental_state), modules/encoder.py (forward_embedding: mask = input != padding_idx, cumsum
#   positions; layer output *= mask), modules/decoder.py (TransformerDecoderLayer, _create_selfattn_mask,
#   TransformerDecoder.forward keeps input[:, -1:] once incr_state exists), modules/generator.py
#   (TransformerGeneratorModel.reorder_encoder_states / reorder_decoder_incremental_state / output),
#   parlai/core/torch_generator_agent.py (TorchGeneratorAgent._generate, _get_next_decoder_input,
#   TreeSearch.advance, BeamSearch.select_paths).
# A ParlAI encoder-decoder (variant aiayn) generating with beam search over a right-padded batch of contexts: the
# encoder returns (tensor, mask) with mask = input != __null__, reorder_encoder_states repeats each row beam_size
# times (index_select on both), the decoder's encoder_attn masks the padded keys with the encoder mask (kept in its
# incr_state as prev_mask, static_kv), and after each step every layer's self_attn and encoder_attn incr_state is
# index_selected by beam_size * i + backtrack. Checked against each context alone, unpadded: the beams' tokens
# and scores, and against a full (uncached) decode of each final hypothesis.
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

NEAR_INF = 1e20


def neginf(dtype):
    return -NEAR_INF if dtype is torch.float32 else -65504.0


LAYER_NORM_EPS = 1e-5

opt = {
    'n_heads': 2, 'n_layers': 2, 'embedding_size': 16, 'ffn_size': 32, 'dropout': 0.0,
    'attention_dropout': 0.0, 'relu_dropout': 0.0, 'learn_positional_embeddings': False,
    'embeddings_scale': True, 'activation': 'relu', 'variant': 'aiayn', 'n_positions': 64,
    'beam_size': 3, 'beam_min_length': 6, 'label_truncate': 6,
}


class DictionaryAgent:
    null_token, start_token, end_token, unk_token = '__null__', '__start__', '__end__', '__unk__'

    def __init__(self, n_words):
        self.tok2ind = {self.null_token: 0, self.start_token: 1, self.end_token: 2, self.unk_token: 3}
        for i in range(4, n_words):
            self.tok2ind['w%d' % i] = i

    def __getitem__(self, key):
        return self.tok2ind[key]

    def __len__(self):
        return len(self.tok2ind)


def create_position_codes(n_pos, dim, out):
    position_enc = np.array([[pos / np.power(10000, 2 * j / dim) for j in range(dim // 2)] for pos in range(n_pos)])
    out.detach_()
    out.requires_grad = False
    out[:, 0::2] = torch.FloatTensor(np.sin(position_enc)).type_as(out)
    out[:, 1::2] = torch.FloatTensor(np.cos(position_enc)).type_as(out)


def create_embeddings(dictionary, embedding_size, padding_idx):
    e = nn.Embedding(len(dictionary), embedding_size, padding_idx)
    nn.init.normal_(e.weight, mean=0, std=embedding_size ** -0.5)
    nn.init.constant_(e.weight[padding_idx], 0)
    return e


class MultiHeadAttention(nn.Module):
    def __init__(self, opt, n_heads=None, dim=None, dropout=0):
        super().__init__()
        self.n_heads = n_heads or opt['n_heads']
        self.dim = dim or opt['embedding_size']
        self.attn_dropout = nn.Dropout(p=dropout)
        self.q_lin = nn.Linear(self.dim, self.dim)
        self.k_lin = nn.Linear(self.dim, self.dim)
        self.v_lin = nn.Linear(self.dim, self.dim)
        nn.init.xavier_normal_(self.q_lin.weight)
        nn.init.xavier_normal_(self.k_lin.weight)
        nn.init.xavier_normal_(self.v_lin.weight)
        self.out_lin = nn.Linear(self.dim, self.dim)
        nn.init.xavier_normal_(self.out_lin.weight)

    def forward(self, query, key=None, value=None, mask=None, incr_state=None, static_kv=False, **kwargs):
        batch_size, query_len, dim = query.size()
        assert mask is not None, 'Mask is None, please specify a mask'
        n_heads = self.n_heads
        dim_per_head = dim // n_heads
        scale = math.sqrt(dim_per_head)

        def prepare_head(tensor):
            bsz, seq_len, _ = tensor.size()
            tensor = tensor.view(batch_size, tensor.size(1), n_heads, dim_per_head)
            tensor = tensor.transpose(1, 2).contiguous().view(batch_size * n_heads, seq_len, dim_per_head)
            return tensor

        if key is None and value is None:
            key = value = query
        elif value is None:
            value = key

        q = prepare_head(self.q_lin(query))

        if incr_state is None:
            incr_state = {}
        if 'prev_key' in incr_state:
            prev_key = incr_state['prev_key'].view(batch_size * n_heads, -1, dim_per_head)
            if static_kv:
                k = prev_key
            else:
                k = torch.cat([prev_key, prepare_head(self.k_lin(key))], dim=1)
        else:
            k = prepare_head(self.k_lin(key))
        if 'prev_value' in incr_state:
            prev_value = incr_state['prev_value'].view(batch_size * n_heads, -1, dim_per_head)
            if static_kv:
                v = prev_value
            else:
                v = torch.cat([prev_value, prepare_head(self.v_lin(value))], dim=1)
        else:
            v = prepare_head(self.v_lin(value))
        if 'prev_mask' in incr_state:
            if static_kv:
                mask = incr_state['prev_mask']
            else:
                prev_mask = incr_state['prev_mask'][:, -query_len:, :]
                mask = torch.cat([prev_mask, mask], dim=2)

        new_incr_state = {
            'prev_key': k.view(batch_size, n_heads, -1, dim_per_head),
            'prev_value': v.view(batch_size, n_heads, -1, dim_per_head),
            'prev_mask': mask,
        }

        full_key_len = k.size(1)
        dot_prod = q.div_(scale).bmm(k.transpose(1, 2))
        attn_mask = (
            (mask == 0)
            .view(batch_size, 1, -1, full_key_len)
            .repeat(1, n_heads, 1, 1)
            .expand(batch_size, n_heads, query_len, full_key_len)
            .view(batch_size * n_heads, query_len, full_key_len)
        )
        assert attn_mask.shape == dot_prod.shape
        dot_prod.masked_fill_(attn_mask, neginf(dot_prod.dtype))
        attn_weights = F.softmax(dot_prod, dim=-1, dtype=torch.float).type_as(query)
        attn_weights = self.attn_dropout(attn_weights)
        attentioned = attn_weights.bmm(v)
        attentioned = (
            attentioned.type_as(query).view(batch_size, n_heads, query_len, dim_per_head)
            .transpose(1, 2).contiguous().view(batch_size, query_len, dim)
        )
        out = self.out_lin(attentioned)
        return out, new_incr_state, dot_prod

    def reorder_incremental_state(self, incremental_state, inds):
        return {
            key: torch.index_select(val, 0, inds.to(val.device)).contiguous()
            for key, val in incremental_state.items()
        }


class TransformerFFN(nn.Module):
    def __init__(self, opt, dim=None, dim_hidden=None, relu_dropout=0, activation='relu'):
        super().__init__()
        self.relu_dropout = nn.Dropout(p=relu_dropout)
        self.nonlinear = F.relu if activation == 'relu' else F.gelu
        self.lin1 = nn.Linear(dim, dim_hidden)
        self.lin2 = nn.Linear(dim_hidden, dim)
        nn.init.xavier_uniform_(self.lin1.weight)
        nn.init.xavier_uniform_(self.lin2.weight)

    def forward(self, x, **kwargs):
        x = self.nonlinear(self.lin1(x))
        x = self.relu_dropout(x)
        return self.lin2(x)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, opt):
        super().__init__()
        d = opt['embedding_size']
        self.variant = opt['variant']
        self.attention = MultiHeadAttention(opt, opt['n_heads'], d, opt['attention_dropout'])
        self.norm1 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.ffn = TransformerFFN(opt, d, opt['ffn_size'], opt['relu_dropout'], opt['activation'])
        self.norm2 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(p=opt['dropout'])

    def forward(self, tensor, mask, **kwargs):
        residual = tensor
        attended_tensor = self.attention(tensor, mask=mask)[0]
        tensor = residual + self.dropout(attended_tensor)
        if self.variant == 'aiayn':
            tensor = self.norm1(tensor)
        residual = tensor
        tensor = residual + self.dropout(self.ffn(tensor))
        if self.variant == 'aiayn':
            tensor = self.norm2(tensor)
        tensor *= mask.unsqueeze(-1).type_as(tensor)
        return tensor


class TransformerEncoder(nn.Module):
    def __init__(self, opt, vocabulary_size, embedding, padding_idx, reduction_type=None, n_positions=1024):
        super().__init__()
        self.embedding_size = opt['embedding_size']
        self.dim = self.embedding_size
        self.padding_idx = padding_idx
        self.reduction_type = reduction_type
        self.embeddings_scale = opt['embeddings_scale']
        self.n_positions = n_positions
        self.embeddings = embedding
        self.dropout = nn.Dropout(p=opt['dropout'])
        self.position_embeddings = nn.Embedding(n_positions, self.embedding_size)
        create_position_codes(n_positions, self.embedding_size, out=self.position_embeddings.weight)
        self.layers = nn.ModuleList([TransformerEncoderLayer(opt) for _ in range(opt['n_layers'])])

    def forward_embedding(self, input, positions=None, segments=None):
        mask = input != self.padding_idx
        if positions is None:
            positions = (mask.cumsum(dim=1, dtype=torch.int64) - 1).clamp_(min=0)
        tensor = self.embeddings(input)
        if self.embeddings_scale:
            tensor = tensor * np.sqrt(self.dim)
        position_embs = self.position_embeddings(positions).expand_as(tensor)
        tensor = tensor + position_embs
        return tensor, mask

    def forward(self, input, positions=None, segments=None):
        tensor, mask = self.forward_embedding(input, positions, segments)
        tensor = self.dropout(tensor)
        tensor *= mask.unsqueeze(-1).type_as(tensor)
        for layer in self.layers:
            tensor = layer(tensor, mask)
        # reduction_type None: TransformerGeneratorModel expects (encoder_output, encoder_mask)
        return tensor, mask


class TransformerDecoderLayer(nn.Module):
    def __init__(self, opt):
        super().__init__()
        d = opt['embedding_size']
        self.variant = opt['variant']
        self.dropout = nn.Dropout(p=opt['dropout'])
        self.self_attention = MultiHeadAttention(opt, opt['n_heads'], d, opt['attention_dropout'])
        self.norm1 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.ffn = TransformerFFN(opt, d, opt['ffn_size'], opt['relu_dropout'], opt['activation'])
        self.norm3 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.encoder_attention = MultiHeadAttention(opt, opt['n_heads'], d, opt['attention_dropout'])
        self.norm2 = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def _create_selfattn_mask(self, x):
        bsz = x.size(0)
        time = x.size(1)
        mask = torch.tril(x.new(time, time).fill_(1))
        mask = mask.unsqueeze(0).expand(bsz, -1, -1)
        return mask

    def forward(self, x, encoder_output, encoder_mask, incr_state=None, **kwargs):
        if incr_state is None:
            incr_state = {}
        decoder_mask = self._create_selfattn_mask(x)
        residual = x
        x, final_self_attn_incr_state = self.self_attention(
            query=x, mask=decoder_mask, incr_state=incr_state.get('self_attn'), static_kv=False)[:2]
        x = self.dropout(x)
        x = x + residual
        x = self.norm1(x)

        residual = x
        x, final_encoder_attn_incr_state = self.encoder_attention(
            query=x, key=encoder_output, value=encoder_output, mask=encoder_mask,
            incr_state=incr_state.get('encoder_attn'), static_kv=True)[:2]
        x = self.dropout(x)
        x = residual + x
        x = self.norm2(x)

        residual = x
        x = self.ffn(x)
        x = self.dropout(x)
        x = residual + x
        x = self.norm3(x)
        new_incr_state = {'self_attn': final_self_attn_incr_state, 'encoder_attn': final_encoder_attn_incr_state}
        return x, new_incr_state

    def reorder_incremental_state(self, incremental_state, inds):
        attn_types = {'self_attn': self.self_attention, 'encoder_attn': self.encoder_attention}
        return {
            attn_type: attn.reorder_incremental_state(incremental_state[attn_type], inds)
            for attn_type, attn in attn_types.items()
        }


class TransformerDecoder(nn.Module):
    def __init__(self, opt, embedding, n_positions=1024):
        super().__init__()
        self.embedding_size = opt['embedding_size']
        self.dim = self.embedding_size
        self.embeddings_scale = opt['embeddings_scale']
        self.dropout = nn.Dropout(p=opt['dropout'])
        self.embeddings = embedding
        self.n_positions = n_positions
        self.position_embeddings = nn.Embedding(n_positions, self.embedding_size)
        create_position_codes(n_positions, self.embedding_size, out=self.position_embeddings.weight)
        self.layers = nn.ModuleList([TransformerDecoderLayer(opt) for _ in range(opt['n_layers'])])

    def forward_embedding(self, input, positions=None, segments=None):
        tensor = self.embeddings(input)
        if self.embeddings_scale:
            tensor = tensor * np.sqrt(self.dim)
        tensor = tensor + self.position_embeddings(positions).expand_as(tensor)
        return tensor

    def forward_layers(self, tensor, *extra_args, incr_state):
        new_incr_state = {}
        for idx, layer in enumerate(self.layers):
            tensor, new_incr_state[idx] = layer(tensor, *extra_args, incr_state=incr_state.get(idx))
        return tensor, new_incr_state

    def forward(self, input, encoder_state, incr_state=None):
        encoder_output, encoder_mask = encoder_state
        seq_len = input.size(1)
        positions = torch.arange(seq_len, dtype=torch.long, device=input.device).unsqueeze(0)
        if incr_state is not None:
            # We're doing incremental decoding, so select only the most recent position
            input = input[:, -1:]
            if positions is not None:
                positions = positions[:, -1:]
        else:
            incr_state = {}
        tensor = self.forward_embedding(input, positions)
        tensor = self.dropout(tensor)
        tensor, new_incr_state = self.forward_layers(tensor, encoder_output, encoder_mask, incr_state=incr_state)
        return tensor, new_incr_state


class TransformerGeneratorModel(nn.Module):
    def __init__(self, opt, dictionary):
        super().__init__()
        self.pad_idx = dictionary[dictionary.null_token]
        self.start_idx = dictionary[dictionary.start_token]
        self.end_idx = dictionary[dictionary.end_token]
        self.register_buffer('START', torch.LongTensor([self.start_idx]))
        self.embeddings = create_embeddings(dictionary, opt['embedding_size'], self.pad_idx)
        n_positions = opt['n_positions']
        self.encoder = TransformerEncoder(opt, len(dictionary), self.embeddings, self.pad_idx,
                                          reduction_type=None, n_positions=n_positions)
        self.decoder = TransformerDecoder(opt, self.embeddings, n_positions=n_positions)

    def reorder_encoder_states(self, encoder_states, indices):
        enc, mask = encoder_states
        if not torch.is_tensor(indices):
            indices = torch.LongTensor(indices).to(enc.device)
        enc = torch.index_select(enc, 0, indices)
        mask = torch.index_select(mask, 0, indices)
        return enc, mask

    def reorder_decoder_incremental_state(self, incremental_state, inds):
        return {
            idx: layer.reorder_incremental_state(incremental_state[idx], inds)
            for idx, layer in enumerate(self.decoder.layers)
        }

    def output(self, tensor):
        output = F.linear(tensor, self.embeddings.weight)
        output[:, :, self.start_idx] = neginf(output.dtype)
        return output

    def decode_forced(self, encoder_states, ys):
        bsz = ys.size(0)
        seqlen = ys.size(1)
        inputs = ys.narrow(1, 0, seqlen - 1)
        inputs = torch.cat([self.START.detach().expand(bsz, 1), inputs], 1)
        latent, _ = self.decoder(inputs, encoder_states)
        logits = self.output(latent)
        _, preds = logits.max(dim=2)
        return logits, preds


class BeamSearch:
    """TreeSearch + BeamSearch.select_paths, without n-gram blocking."""

    def __init__(self, beam_size, min_length, padding_token=0, bos_token=1, eos_token=2, device='cpu'):
        self.beam_size = beam_size
        self.min_length = min_length
        self.eos = eos_token
        self.scores = None
        self.all_scores = [torch.Tensor([0.0] * beam_size).to(device)]
        self.outputs = [torch.Tensor(beam_size).long().fill_(bos_token).to(device)]
        self.bookkeep = []
        self.partial_hyps = torch.tensor([[bos_token] for _ in range(beam_size)], device=device)
        self.finished = []
        self.eos_top = False
        self.n_best_counter = 0

    def select_paths(self, logprobs, prior_scores, current_length):
        if prior_scores.numel() == 1:
            logprobs = logprobs[0:1]
        beam_scores = logprobs + prior_scores.unsqueeze(1).expand_as(logprobs)
        flat_beam_scores = beam_scores.view(-1)
        best_scores, best_idxs = torch.topk(flat_beam_scores, self.beam_size, dim=-1)
        voc_size = logprobs.size(-1)
        hyp_ids = torch.div(best_idxs, voc_size, rounding_mode='trunc')
        tok_ids = best_idxs % voc_size
        return hyp_ids, tok_ids, best_scores

    def advance(self, logprobs, step):
        current_length = len(self.all_scores) - 1
        if current_length < self.min_length:
            for hyp_id in range(logprobs.size(0)):
                logprobs[hyp_id][self.eos] = neginf(logprobs.dtype)
        if self.scores is None:
            self.scores = torch.zeros(1).type_as(logprobs).to(logprobs.device)
        for hyp_id, token in enumerate(self.outputs[-1]):
            if token == self.eos:
                self.scores[hyp_id] = neginf(self.scores.dtype)
        hyp_ids, tok_ids, scores = self.select_paths(logprobs, self.scores, current_length)
        self.scores = scores
        self.all_scores.append(self.scores.clone())
        self.outputs.append(tok_ids)
        self.bookkeep.append(hyp_ids)
        self.partial_hyps = torch.cat((self.partial_hyps[hyp_ids.long()], tok_ids.view(tok_ids.shape[0], -1)), 1)
        for hypid in range(self.beam_size):
            if self.outputs[-1][hypid] == self.eos:
                if self.scores[hypid] <= neginf(self.scores.dtype):
                    continue
                self.finished.append((len(self.outputs) - 1, hypid, self.all_scores[-1][hypid]))
                self.n_best_counter += 1
        if self.outputs[-1][0] == self.eos:
            self.eos_top = True

    def is_done(self):
        return self.eos_top and self.n_best_counter >= self.beam_size

    def get_output_from_current_step(self):
        return self.outputs[-1]

    def get_backtrack_from_current_step(self):
        return self.bookkeep[-1]


def _generate(model, text_vec, beam_size, max_ts):
    """TorchGeneratorAgent._generate, trimmed to beam search without prefix tokens."""
    encoder_states = model.encoder(text_vec)
    dev = text_vec.device
    bsz = text_vec.size(0)
    beams = [BeamSearch(beam_size, opt['beam_min_length'], model.pad_idx, model.start_idx, model.end_idx, dev)
             for _ in range(bsz)]
    decoder_input = torch.LongTensor([model.start_idx]).expand(bsz * beam_size, 1).to(dev)
    inds = torch.arange(bsz).to(dev).unsqueeze(1).repeat(1, beam_size).view(-1)
    encoder_states = model.reorder_encoder_states(encoder_states, inds)
    incr_state = None
    for _ts in range(max_ts):
        if all((b.is_done() for b in beams)):
            break
        score, incr_state = model.decoder(decoder_input, encoder_states, incr_state)
        score = score[:, -1:, :]
        score = model.output(score)
        score = score.view(bsz, beam_size, -1)
        score = F.log_softmax(score, dim=-1, dtype=torch.float32)
        for i, b in enumerate(beams):
            if not b.is_done():
                b.advance(score[i], _ts)
        incr_state_inds = torch.cat([beam_size * i + b.get_backtrack_from_current_step() for i, b in enumerate(beams)])
        incr_state = model.reorder_decoder_incremental_state(incr_state, incr_state_inds)
        selection = torch.cat([b.get_output_from_current_step() for b in beams]).unsqueeze(-1)
        prev_input = torch.index_select(decoder_input, 0, incr_state_inds)
        decoder_input = torch.cat([prev_input, selection], dim=-1)
    return beams, decoder_input


def batchify(texts, pad_idx):
    """ParlAI's padded_tensor: right padding with __null__."""
    max_len = max(len(t) for t in texts)
    out = torch.full((len(texts), max_len), pad_idx, dtype=torch.long)
    for i, t in enumerate(texts):
        out[i, :len(t)] = torch.LongTensor(t)
    return out


dictionary = DictionaryAgent(24)
model = TransformerGeneratorModel(opt, dictionary).eval()
with torch.no_grad():
    for p in model.parameters():  # sharper distributions so beams separate clearly
        if p.dim() > 1:
            p.mul_(2.0)
    model.embeddings.weight[model.pad_idx].zero_()

texts = [[5, 9, 13, 7, 11, 20, 2], [6, 17, 2], [8, 4, 19, 15, 2]]
beam_size, max_ts = opt['beam_size'], opt['label_truncate']
text_vec = batchify(texts, model.pad_idx)

with torch.no_grad():
    beams, decoder_input = _generate(model, text_vec, beam_size, max_ts)
    for i, t in enumerate(texts):
        alone_beams, alone_input = _generate(model, torch.LongTensor([t]), beam_size, max_ts)
        b, a = beams[i], alone_beams[0]
        assert torch.equal(b.partial_hyps, a.partial_hyps), (i, b.partial_hyps, a.partial_hyps)
        assert torch.allclose(b.scores, a.scores, atol=1e-5), (i, b.scores, a.scores)
        assert torch.equal(decoder_input[i * beam_size:(i + 1) * beam_size], alone_input)
        # reference: each final hypothesis rescored by a full, uncached decode of the context alone
        enc = model.encoder(torch.LongTensor([t]))
        enc = model.reorder_encoder_states(enc, torch.zeros(beam_size, dtype=torch.long))
        ys = b.partial_hyps[:, 1:]
        logits, _ = model.decode_forced(enc, ys)
        lp = F.log_softmax(logits, dim=-1, dtype=torch.float32)
        total = lp.gather(2, ys.unsqueeze(-1)).squeeze(-1).sum(1)
        assert torch.allclose(total, b.scores, atol=1e-4), (i, total, b.scores)
        assert len(set(map(tuple, ys.tolist()))) == beam_size
print("ok: ParlAI beam search over right-padded contexts matches each context alone and a full decode")
