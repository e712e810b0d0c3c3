"""UNITER (ChenRocks/UNITER) image-text retrieval: each pair's caption tokens and
detected-region features are packed into one compact sequence by `gather_index`
(text first, the regions right after the caption's last real token, padding only
at the end of each row), and one key padding mask `attn_masks` (ones over tl + nbb,
zeros after) is turned into BERT's additive (1 - mask) * -10000 bias.

Port of model/model.py @966a5f8ed4afcf70c4da076efaef97009affa057 (UniterConfig,
UniterTextEmbeddings, UniterImageEmbeddings, UniterEncoder, UniterModel with
_compute_img_txt_embeddings / forward), model/layer.py @966a5f8 (BertSelfAttention,
BertLayer, BertPooler), model/itm.py @fb5c790da22c801513d2fd65fd8c80def11892a7
(UniterForImageTextRetrieval, triplet rank loss), data/data.py
@b38036f4ed4fa72d79aff47bb009c17dda2c8a84 (pad_tensors, get_gather_index) and
data/itm.py @735faa49b20f86e464ca475625df0658b647307a (_collect_inputs,
itm_rank_collate; ItmValDataset.get_batch: one caption against images of different
box counts). apex FusedLayerNorm is nn.LayerNorm here; tiny sizes, random weights,
no lmdb: captions are fixed id lists, regions random features.

Reference: each (caption, image) pair run alone with no padding at all, embeddings
simply concatenated [text; regions]; hidden states at the real positions, pooled
rank scores and the triplet loss must match the batched run.
"""
import copy
import math
from collections import defaultdict

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

BertLayerNorm = nn.LayerNorm


# ------------------------------------------------------------------ model/model.py
class UniterConfig(object):
    def __init__(self, vocab_size_or_config_json_file, hidden_size=768,
                 num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, hidden_act="gelu",
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                 max_position_embeddings=512, type_vocab_size=2,
                 initializer_range=0.02):
        self.vocab_size = vocab_size_or_config_json_file
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.initializer_range = initializer_range


def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


ACT2FN = {"gelu": gelu, "relu": torch.nn.functional.relu}


# ------------------------------------------------------------------ model/layer.py
class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super(BertSelfAttention, self).__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super(BertSelfOutput, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config):
        super(BertAttention, self).__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, attention_mask):
        self_output = self.self(input_tensor, attention_mask)
        return self.output(self_output, input_tensor)


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super(BertIntermediate, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    def __init__(self, config):
        super(BertOutput, self).__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config):
        super(BertLayer, self).__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        intermediate_output = self.intermediate(attention_output)
        return self.output(intermediate_output, attention_output)


class BertPooler(nn.Module):
    def __init__(self, config):
        super(BertPooler, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        first_token_tensor = hidden_states[:, 0]
        return self.activation(self.dense(first_token_tensor))


# ------------------------------------------------------------------ model/model.py
class UniterPreTrainedModel(nn.Module):
    def __init__(self, config, *inputs, **kwargs):
        super().__init__()
        self.config = config

    def init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, BertLayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


class UniterTextEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, position_ids, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = (self.word_embeddings(input_ids)
                      + self.position_embeddings(position_ids)
                      + self.token_type_embeddings(token_type_ids))
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class UniterImageEmbeddings(nn.Module):
    def __init__(self, config, img_dim):
        super().__init__()
        self.img_linear = nn.Linear(img_dim, config.hidden_size)
        self.img_layer_norm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.pos_layer_norm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.pos_linear = nn.Linear(7, config.hidden_size)
        self.mask_embedding = nn.Embedding(2, img_dim, padding_idx=0)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, img_feat, img_pos_feat, type_embeddings, img_masks=None):
        if img_masks is not None:
            self.mask_embedding.weight.data[0, :].fill_(0)
            mask = self.mask_embedding(img_masks.long())
            img_feat = img_feat + mask
        transformed_im = self.img_layer_norm(self.img_linear(img_feat))
        transformed_pos = self.pos_layer_norm(self.pos_linear(img_pos_feat))
        embeddings = transformed_im + transformed_pos + type_embeddings
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class UniterEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        layer = BertLayer(config)
        self.layer = nn.ModuleList([copy.deepcopy(layer) for _ in range(config.num_hidden_layers)])

    def forward(self, input_, attention_mask, output_all_encoded_layers=True):
        all_encoder_layers = []
        hidden_states = input_
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
            if output_all_encoded_layers:
                all_encoder_layers.append(hidden_states)
        if not output_all_encoded_layers:
            all_encoder_layers.append(hidden_states)
        return all_encoder_layers


class UniterModel(UniterPreTrainedModel):
    def __init__(self, config, img_dim):
        super().__init__(config)
        self.embeddings = UniterTextEmbeddings(config)
        self.img_embeddings = UniterImageEmbeddings(config, img_dim)
        self.encoder = UniterEncoder(config)
        self.pooler = BertPooler(config)
        self.apply(self.init_weights)

    def _compute_txt_embeddings(self, input_ids, position_ids, txt_type_ids=None):
        return self.embeddings(input_ids, position_ids, txt_type_ids)

    def _compute_img_embeddings(self, img_feat, img_pos_feat, img_masks=None, img_type_ids=None):
        if img_type_ids is None:
            img_type_ids = torch.ones_like(img_feat[:, :, 0].long())
        img_type_embeddings = self.embeddings.token_type_embeddings(img_type_ids)
        return self.img_embeddings(img_feat, img_pos_feat, img_type_embeddings, img_masks)

    def _compute_img_txt_embeddings(self, input_ids, position_ids, img_feat, img_pos_feat,
                                    gather_index, img_masks=None,
                                    txt_type_ids=None, img_type_ids=None):
        txt_emb = self._compute_txt_embeddings(input_ids, position_ids, txt_type_ids)
        img_emb = self._compute_img_embeddings(img_feat, img_pos_feat, img_masks, img_type_ids)
        # align back to most compact input
        gather_index = gather_index.unsqueeze(-1).expand(-1, -1, self.config.hidden_size)
        embedding_output = torch.gather(torch.cat([txt_emb, img_emb], dim=1),
                                        dim=1, index=gather_index)
        return embedding_output

    def forward(self, input_ids, position_ids, img_feat, img_pos_feat,
                attention_mask, gather_index=None, img_masks=None,
                output_all_encoded_layers=True, txt_type_ids=None, img_type_ids=None):
        # compute self-attention mask
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(
            dtype=next(self.parameters()).dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        if input_ids is None:
            embedding_output = self._compute_img_embeddings(img_feat, img_pos_feat, img_masks, img_type_ids)
        elif img_feat is None:
            embedding_output = self._compute_txt_embeddings(input_ids, position_ids, txt_type_ids)
        else:
            embedding_output = self._compute_img_txt_embeddings(
                input_ids, position_ids, img_feat, img_pos_feat,
                gather_index, img_masks, txt_type_ids, img_type_ids)

        encoded_layers = self.encoder(embedding_output, extended_attention_mask,
                                      output_all_encoded_layers=output_all_encoded_layers)
        if not output_all_encoded_layers:
            encoded_layers = encoded_layers[-1]
        return encoded_layers


# ------------------------------------------------------------------ model/itm.py
class UniterForImageTextRetrieval(UniterPreTrainedModel):
    def __init__(self, config, img_dim, margin=0.2):
        super().__init__(config)
        self.uniter = UniterModel(config, img_dim)
        self.itm_output = nn.Linear(config.hidden_size, 2)
        self.rank_output = nn.Linear(config.hidden_size, 1)
        self.margin = margin
        self.apply(self.init_weights)

    def forward(self, batch, compute_loss=True):
        batch = defaultdict(lambda: None, batch)
        sequence_output = self.uniter(batch['input_ids'], batch['position_ids'],
                                      batch['img_feat'], batch['img_pos_feat'],
                                      batch['attn_masks'], batch['gather_index'],
                                      output_all_encoded_layers=False)
        pooled_output = self.uniter.pooler(sequence_output)
        rank_scores = self.rank_output(pooled_output)
        if compute_loss:
            rank_scores_sigmoid = torch.sigmoid(rank_scores)
            sample_size = batch['sample_size']
            scores = rank_scores_sigmoid.contiguous().view(-1, sample_size)
            pos = scores[:, :1]
            neg = scores[:, 1:]
            rank_loss = torch.clamp(self.margin + neg - pos, 0)
            return rank_loss
        return rank_scores


# ------------------------------------------------------------------ data/data.py
def pad_tensors(tensors, lens=None, pad=0):
    """B x [T, ...]"""
    if lens is None:
        lens = [t.size(0) for t in tensors]
    max_len = max(lens)
    bs = len(tensors)
    hid = tensors[0].size(-1)
    dtype = tensors[0].dtype
    output = torch.zeros(bs, max_len, hid, dtype=dtype)
    if pad:
        output.data.fill_(pad)
    for i, (t, l) in enumerate(zip(tensors, lens)):
        output.data[i, :l, ...] = t.data
    return output


def get_gather_index(txt_lens, num_bbs, batch_size, max_len, out_size):
    assert len(txt_lens) == len(num_bbs) == batch_size
    gather_index = torch.arange(0, out_size, dtype=torch.long).unsqueeze(0).repeat(batch_size, 1)
    for i, (tl, nbb) in enumerate(zip(txt_lens, num_bbs)):
        gather_index.data[i, tl:tl + nbb] = torch.arange(max_len, max_len + nbb, dtype=torch.long).data
    return gather_index


# ------------------------------------------------------------------ data/itm.py
CLS, SEP = 101, 102


def combine_inputs(*inputs):
    input_ids = [CLS]
    for ids in inputs:
        input_ids.extend(ids + [SEP])
    return torch.tensor(input_ids)


def get_img_feat(img_db, fname):
    img_feat, bb = img_db[fname]
    img_bb = torch.cat([bb, bb[:, 4:5] * bb[:, 5:]], dim=-1)
    return img_feat, img_bb, img_feat.size(0)


def collect_inputs(txt_db, img_db, id_pairs):
    inputs = []
    for txt_id, img_id in id_pairs:
        input_ids = combine_inputs(txt_db[txt_id])
        img_feat, img_pos_feat, num_bb = get_img_feat(img_db, img_id)
        attn_masks = torch.ones(len(input_ids) + num_bb, dtype=torch.long)
        inputs.append((input_ids, img_feat, img_pos_feat, attn_masks))
    return inputs


def itm_rank_collate(inputs):
    input_ids, img_feats, img_pos_feats, attn_masks = map(list, zip(*[x for i in inputs for x in i]))
    txt_lens = [i.size(0) for i in input_ids]
    input_ids = pad_sequence(input_ids, batch_first=True, padding_value=0)
    position_ids = torch.arange(0, input_ids.size(1), dtype=torch.long).unsqueeze(0)

    num_bbs = [f.size(0) for f in img_feats]
    img_feat = pad_tensors(img_feats, num_bbs)
    img_pos_feat = pad_tensors(img_pos_feats, num_bbs)

    attn_masks = pad_sequence(attn_masks, batch_first=True, padding_value=0)
    sample_size = len(inputs[0])
    assert all(sample_size == len(i) for i in inputs)

    bs, max_tl = input_ids.size()
    out_size = attn_masks.size(1)
    gather_index = get_gather_index(txt_lens, num_bbs, bs, max_tl, out_size)
    return {'input_ids': input_ids, 'position_ids': position_ids,
            'img_feat': img_feat, 'img_pos_feat': img_pos_feat,
            'attn_masks': attn_masks, 'gather_index': gather_index,
            'sample_size': sample_size}


def itm_val_get_batch(txt_db, img_db, txt_id, img_ids):
    """ItmValDataset.get_batch: one caption scored against several images."""
    input_ids = combine_inputs(txt_db[txt_id])
    input_ids = input_ids.unsqueeze(0).expand(len(img_ids), -1).clone()
    position_ids = torch.arange(0, input_ids.size(1), dtype=torch.long).unsqueeze(0)
    img_feats, img_pos_feats, num_bbs = map(list, zip(*[get_img_feat(img_db, i) for i in img_ids]))
    img_feat = pad_tensors(img_feats, num_bbs)
    img_pos_feat = pad_tensors(img_pos_feats, num_bbs)
    tl = input_ids.size(1)
    attn_masks = torch.zeros(len(img_ids), max(num_bbs) + tl).long()
    for i, nbb in enumerate(num_bbs):
        attn_masks.data[i, :tl + nbb].fill_(1)
    out_size = attn_masks.size(1)
    gather_index = get_gather_index([tl] * len(img_ids), num_bbs, len(img_ids), tl, out_size)
    return {'input_ids': input_ids, 'position_ids': position_ids,
            'img_feat': img_feat, 'img_pos_feat': img_pos_feat,
            'attn_masks': attn_masks, 'gather_index': gather_index}


# ------------------------------------------------------------------ reference
def run_pair_alone(model, input_ids, img_feat, img_bb):
    """One pair, no padding, no gather: [text; regions] concatenated, no mask."""
    uniter = model.uniter
    ids = input_ids.unsqueeze(0)
    pos = torch.arange(ids.size(1)).unsqueeze(0)
    txt = uniter._compute_txt_embeddings(ids, pos)
    img = uniter._compute_img_embeddings(img_feat.unsqueeze(0), img_bb.unsqueeze(0))
    h = torch.cat([txt, img], dim=1)
    for layer in uniter.encoder.layer:
        h = layer(h, torch.zeros(1, 1, 1, h.size(1)))
    score = model.rank_output(uniter.pooler(h))
    return h[0], score[0, 0]


def main():
    torch.manual_seed(0)
    config = UniterConfig(200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64,
                          initializer_range=0.2)
    img_dim = 24
    model = UniterForImageTextRetrieval(config, img_dim, margin=0.2).eval()

    g = torch.Generator().manual_seed(1)
    txt_db = {f"t{i}": torch.randint(5, 199, (n,), generator=g).tolist()
              for i, n in enumerate([3, 6, 1, 4, 2])}
    img_db = {}
    for i, nbb in enumerate([5, 2, 7, 3]):
        bb = torch.rand(nbb, 6, generator=g)
        img_db[f"img{i}"] = (torch.randn(nbb, img_dim, generator=g), bb)

    # training batch: two ground-truth pairs, each with 1 negative image, 1 negative text
    examples = [[("t0", "img0"), ("t0", "img2"), ("t3", "img0")],
                [("t1", "img1"), ("t1", "img3"), ("t4", "img1")]]
    inputs = [collect_inputs(txt_db, img_db, ex) for ex in examples]
    batch = itm_rank_collate(inputs)
    with torch.no_grad():
        rank_loss = model(batch, compute_loss=True)
        seq = model.uniter(batch['input_ids'], batch['position_ids'], batch['img_feat'],
                           batch['img_pos_feat'], batch['attn_masks'], batch['gather_index'],
                           output_all_encoded_layers=False)
        scores = model(batch, compute_loss=False)[:, 0]

        ref_scores = []
        row = 0
        for ex in examples:
            for txt_id, img_id in ex:
                ids = combine_inputs(txt_db[txt_id])
                feat, bb, nbb = get_img_feat(img_db, img_id)
                h, s = run_pair_alone(model, ids, feat, bb)
                n = ids.size(0) + nbb
                assert int(batch['attn_masks'][row].sum()) == n
                torch.testing.assert_close(seq[row, :n], h, atol=1e-5, rtol=1e-4)
                ref_scores.append(s)
                row += 1
        ref_scores = torch.stack(ref_scores)
        torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-4)

        # triplet loss as a double loop over groups and negatives
        ref_loss = torch.zeros(len(examples), len(examples[0]) - 1)
        for gi in range(len(examples)):
            pos = torch.sigmoid(ref_scores[gi * 3])
            for k in range(1, 3):
                neg = torch.sigmoid(ref_scores[gi * 3 + k])
                ref_loss[gi, k - 1] = max(0.2 + neg - pos, 0.0)
        torch.testing.assert_close(rank_loss, ref_loss, atol=1e-5, rtol=1e-4)

        # evaluation: one caption against all images (different box counts)
        img_ids = ["img2", "img0", "img1", "img3"]
        vbatch = itm_val_get_batch(txt_db, img_db, "t1", img_ids)
        vscores = model(vbatch, compute_loss=False)[:, 0]
        for i, img_id in enumerate(img_ids):
            feat, bb, _ = get_img_feat(img_db, img_id)
            _, s = run_pair_alone(model, combine_inputs(txt_db["t1"]), feat, bb)
            torch.testing.assert_close(vscores[i], s, atol=1e-5, rtol=1e-4)
    print("ok: UNITER gather_index batches match each pair run alone;",
          "scores", [round(float(x), 4) for x in scores])


if __name__ == "__main__":
    main()
