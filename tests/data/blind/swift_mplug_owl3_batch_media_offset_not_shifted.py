"""ms-swift mPLUG-Owl3 template: a batch's media_offset is concatenated without shifting it by the images before it.

Citation: modelscope/ms-swift#2100 (commit 230a1a26e, "Fix the issue with media_offset in owl3 when
batch_size > 1"); see also X-PLUG/mPLUG-Owl#247. Code read at 230a1a26e^ (swift/llm/utils/template.py,
``mPlugOwl3Template._encode`` / ``data_collator``) and in the model's modeling_hyper_qwen2.py / sdpa.py
(mPLUG/mPLUG-Owl3-7B-240728: ``make_t2v_mask``, ``select_query``, ``HyperQwen2Attention.crossattention``,
``ScaleDotProductAttention``).

mPLUG-Owl3's hyper attention lets each text token attend to the images that came before it. The span of
images a row may see is ``media_offset[b, t] = [start, end)``, indices into ``image_embeds``, which the
collator concatenates over the whole batch. ``crossattention`` slices ``vision_features[start:end]`` for
each row and masks it with ``make_t2v_mask`` (token t sees image j only if j < media_offset[b, t, 1]).

The bug: ``_encode`` writes each sample's media_offset counting from 0 (its own images), and
``data_collator`` just did ``torch.concat(media_offset)``. Row b > 0 therefore cross-attends to the
first rows' images (the images of sample 0) instead of its own. Rows of unequal length made the concat
fail, but a batch whose samples tokenize to the same length runs through.

The fix: pad each media_offset to the batch length with its last value and add ``cusum_offset``, the
number of images of the samples before it (``num_images``, later ``image_embeds[bi].shape[0]``).

Trimmed to the template's encode and collator, one HyperQwen2 decoder layer (causal SDPA self-attention
plus the gated hyper cross-attention; MI-Rope on the image keys is left out) and the LM loss, with tiny
sizes and random weights. einops ``rearrange``/``repeat`` are written out with torch ops.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen2Config

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

IMAGE_TOKEN_ID = 7  # '<|image|>'
PAD_TOKEN_ID = 0
LENGTH_EACH_IMG = 4


def _findall(token_list, sub_token_list):
    if isinstance(sub_token_list, int):
        sub_token_list = [sub_token_list]
    res = []
    idx = -1
    try:
        while True:
            idx = token_list.index(sub_token_list[0], idx + 1)
            if len(sub_token_list) == 1 or sub_token_list == token_list[idx:idx + len(sub_token_list)]:
                res.append(idx)
    except ValueError:
        pass
    return res


# ---------------------------------------------------------------- template (swift/llm/utils/template.py)
class mPlugOwl3Template:
    padding_side = "right"

    def _encode(self, example):
        # input_ids after super()._encode: every image tag replaced by [-100]
        input_ids = list(example["input_ids"])
        labels = list(example["labels"])
        images = example["images"]
        idx_list = _findall(input_ids, -100)
        inputs = {}
        if images:
            added_tokens_len = 0
            image_token_list = [IMAGE_TOKEN_ID]
            for idx in idx_list:
                token_list = image_token_list
                input_ids = input_ids[:idx + added_tokens_len] + token_list + input_ids[added_tokens_len + idx + 1:]
                if labels:
                    labels = labels[:idx + added_tokens_len] + [-100] * len(token_list) + labels[added_tokens_len + idx
                                                                                                 + 1:]
                added_tokens_len += len(token_list) - 1
            image_token_idx = torch.tensor(_findall(input_ids, image_token_list))[None]
            _range = torch.arange(len(input_ids))[:, None]
            matrix = (_range > image_token_idx).sum(dim=1)
            media_offset = torch.stack([torch.zeros(matrix.shape[0], dtype=torch.long), matrix], dim=-1)[None]
            inputs['_data'] = {'pixel_values': images}
            inputs['media_offset'] = media_offset
            inputs['num_images'] = len(images)
        inputs['input_ids'] = input_ids
        inputs['labels'] = labels
        return inputs

    def _post_encode(self, model, data):
        image_embeds = model.forward_image(data['pixel_values'])
        return {'image_embeds': image_embeds}

    def _base_data_collator(self, batch, padding_to=None):
        # Template.data_collator: right padding of input_ids / labels / attention_mask
        max_len = max(len(b['input_ids']) for b in batch)
        if padding_to is not None:
            max_len = max(max_len, padding_to)
        input_ids, labels, attention_mask = [], [], []
        for b in batch:
            n = max_len - len(b['input_ids'])
            input_ids.append(b['input_ids'] + [PAD_TOKEN_ID] * n)
            labels.append(b['labels'] + [-100] * n)
            attention_mask.append([1] * len(b['input_ids']) + [0] * n)
        return {
            'input_ids': torch.tensor(input_ids),
            'labels': torch.tensor(labels),
            'attention_mask': torch.tensor(attention_mask),
        }

    def data_collator(self, batch, padding_to=None):
        res = self._base_data_collator(batch, padding_to)
        image_embeds = [b['image_embeds'] for b in batch if 'image_embeds' in b]
        if image_embeds:
            res['image_embeds'] = torch.concat(image_embeds)
        if not FIXED:
            media_offset = [b['media_offset'] for b in batch if 'media_offset' in b]
        else:
            num_images = [b['num_images'] if 'num_images' in b else 0 for b in batch]
            media_offset = []
            cusum_offset = 0
            for bi, b in enumerate(batch):
                if 'media_offset' in b:
                    max_sequence_length = res['input_ids'].shape[1]
                    curr_media_offset = b['media_offset']
                    if curr_media_offset.shape[1] < max_sequence_length:
                        padding = curr_media_offset[:, -1:, :].expand(curr_media_offset.shape[0],
                                                                      max_sequence_length - curr_media_offset.shape[1],
                                                                      curr_media_offset.shape[2])
                        curr_media_offset = torch.concat([curr_media_offset, padding], dim=1)
                    media_offset.append(curr_media_offset + cusum_offset)
                    cusum_offset += num_images[bi]
        if media_offset:
            res['media_offset'] = torch.concat(media_offset)
        return res


# ---------------------------------------------------------------- model (modeling_hyper_qwen2.py, sdpa.py)
def make_t2v_mask(media_offset_line, num_images):
    assert len(media_offset_line.shape) == 1
    media_offset_line = media_offset_line.view(-1, 1)
    visual_arange = torch.arange(num_images, device=media_offset_line.device).view(1, -1)
    mask = (media_offset_line <= visual_arange)
    return mask


def select_query(media_offset, num_queries=None):
    query_indices = media_offset[:, :, 1] >= 0  # B L
    assert query_indices.sum().item() % num_queries == 0, query_indices.sum().item()
    query_indices = query_indices.nonzero()
    ptr = 0
    while ptr < query_indices.shape[0]:
        first_query_index, last_query_index = query_indices[ptr], query_indices[ptr + num_queries - 1]
        assert (last_query_index[1] - first_query_index[1] + 1).item() == num_queries
        assert last_query_index[0].item() == first_query_index[0].item()
        batch_id, begin_i, end_i = first_query_index[0].item(), first_query_index[1].item(), first_query_index[1].item() + num_queries
        yield batch_id, begin_i, end_i

        ptr += num_queries


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class ScaleDotProductAttention(nn.Module):

    def __init__(self, layer_number, causal=False, softmax_scale=None, attention_dropout=0.0):
        super().__init__()
        self.layer_number = layer_number
        self.causal = causal
        self.softmax_scale = softmax_scale
        self.dropout_p = attention_dropout

    def forward(self, q, k, v, attn_mask=None, order='sbhd'):
        if order == 'sbhd':
            q, k, v = [x.permute(1, 2, 0, 3).contiguous() for x in (q, k, v)]
        elif order == 'bhsd':
            pass

        if attn_mask is not None:
            attn_mask = (~attn_mask.clone().bool()).contiguous()
        else:
            attn_mask = None
        # attention mask, True means it will take part in attention B H s_q s_k
        if self.training:
            is_causal = self.causal
            dropout_p = self.dropout_p
        else:
            is_causal = self.causal
            dropout_p = 0.0

        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                           scale=self.softmax_scale)
        # B Head L D -> L B (Head D)
        B, Hh, L, D = o.shape
        o = o.permute(2, 0, 1, 3).reshape(L, B, Hh * D).contiguous()
        return o


class HyperQwen2SdpaAttention(nn.Module):

    def __init__(self, config, layer_idx=0, is_hyper_enabed=True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.is_hyper_enabed = is_hyper_enabed
        if self.is_hyper_enabed:
            self.v_kv_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim * 2, bias=True)
            self.gate_proj = nn.Sequential(
                nn.Linear(self.head_dim, self.head_dim),
                nn.Sigmoid()
            )
            self.v_core_attention_sdpa = ScaleDotProductAttention(layer_number=-1, causal=False,
                                                                  attention_dropout=self.attention_dropout)
            self.visual_cache = {}

    def crossattention(self, query_layer, vision_features, media_offset, context_layer):
        '''
        query_layer: [s b h d]
        vision_features: [b' lv d]
        context_layer: s b d
        '''
        if vision_features is None or (self.is_hyper_enabed == False):
            return context_layer
        context_layer_clone = context_layer.clone()
        # obtain dynamic gate value
        L_c, B_c = context_layer.shape[:2]
        D_head = self.head_dim
        context_layer_gate = self.gate_proj(context_layer.reshape(L_c * B_c * self.num_heads, D_head)).reshape(
            L_c, B_c, self.num_heads * D_head)

        vision_features = vision_features.contiguous()
        vision_features = self.v_kv_proj(vision_features)
        length_each_img = vision_features.shape[1]
        sequence_length = query_layer.shape[0]
        if sequence_length == 1:
            completion_flag = True
            media_offset = media_offset[:, -1:]
        else:
            completion_flag = False
            self.visual_cache['media_offset'] = media_offset
            self.visual_cache['vision_features'] = vision_features
        query_layer = query_layer.permute(1, 2, 0, 3)  # L B H D -> B H L D
        assert sequence_length == media_offset.shape[1], (sequence_length, media_offset.shape)

        for batch_id, begin_i, end_i in select_query(media_offset, sequence_length):
            assert begin_i == 0
            assert end_i == sequence_length, (end_i, sequence_length)
            curr_offset = media_offset[batch_id, end_i - 1]
            if (not completion_flag):
                re_to_zero_media_offset = (media_offset[batch_id, :, 1] - curr_offset[0]).to(query_layer.device)
                query_shift = re_to_zero_media_offset.nonzero()[0].item()
                curr_mask = make_t2v_mask(
                    re_to_zero_media_offset[query_shift:],
                    num_images=curr_offset[1] - curr_offset[0],
                )
                # 's_q s_k -> B H s_q (s_k img_l)'
                curr_mask = curr_mask[None, None, :, :, None].expand(-1, -1, -1, -1, length_each_img).reshape(
                    1, 1, curr_mask.shape[0], curr_mask.shape[1] * length_each_img)
            else:
                curr_mask = None
                query_shift = 0

            curr_query_tokens = query_layer[batch_id, :, query_shift:].unsqueeze(0).clone().contiguous()

            assert curr_offset[0] < vision_features.shape[0]
            assert curr_offset[1] <= vision_features.shape[0]

            # 'BL Lv (H KV D) -> KV 1 H (BL Lv) D'
            curr_v = vision_features[curr_offset[0]:curr_offset[1]].clone()
            BL, Lv, _ = curr_v.shape
            curr_vision_kv = curr_v.reshape(BL, Lv, self.num_key_value_heads, 2, self.head_dim).permute(
                3, 2, 0, 1, 4).reshape(2, 1, self.num_key_value_heads, BL * Lv, self.head_dim)
            key_layer = curr_vision_kv[0].contiguous()  # [b h s d]
            value_layer = curr_vision_kv[1].contiguous()

            key_layer = repeat_kv(key_layer, self.num_key_value_groups)
            value_layer = repeat_kv(value_layer, self.num_key_value_groups)

            v_context_layer = self.v_core_attention_sdpa(curr_query_tokens, key_layer, value_layer, attn_mask=curr_mask,
                                                         order='bhsd').squeeze(1)

            gate_value = context_layer_gate[query_shift:, batch_id]
            context_layer_clone[query_shift:, batch_id] = context_layer[query_shift:, batch_id].clone() * (
                1 - gate_value) + v_context_layer * gate_value

        return context_layer_clone

    def forward(self, hidden_states, attention_mask=None, image_embeds=None, media_offset=None):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=attention_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).contiguous()
        attn_output = attn_output.view(bsz, q_len, self.hidden_size)

        # Hyper Attention
        attn_output = self.crossattention(query_states.permute(2, 0, 1, 3), image_embeds, media_offset,
                                          attn_output.permute(1, 0, 2))
        attn_output = attn_output.permute(1, 0, 2)

        attn_output = self.o_proj(attn_output)
        return attn_output


class TinyOwl3(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.vision2text = nn.Linear(12, config.hidden_size)
        self.self_attn = HyperQwen2SdpaAttention(config, layer_idx=0, is_hyper_enabed=True)
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward_image(self, pixel_values):
        # stand-in vision tower + projector: (n_img, LENGTH_EACH_IMG, 12) -> (n_img, LENGTH_EACH_IMG, hidden)
        return self.vision2text(torch.stack(pixel_values))

    def _prepare_4d_causal_mask(self, attention_mask, dtype):
        bsz, L = attention_mask.shape
        min_dtype = torch.finfo(dtype).min
        causal = torch.triu(torch.full((L, L), min_dtype, dtype=dtype), diagonal=1)
        causal = causal[None, None].expand(bsz, 1, L, L).clone()
        pad = attention_mask[:, None, None, :] == 0
        return causal.masked_fill(pad, min_dtype)

    def forward(self, input_ids, attention_mask, labels, image_embeds=None, media_offset=None):
        inputs_embeds = self.embed_tokens(input_ids)
        mask = self._prepare_4d_causal_mask(attention_mask, inputs_embeds.dtype)
        h = inputs_embeds + self.self_attn(inputs_embeds, attention_mask=mask, image_embeds=image_embeds,
                                           media_offset=media_offset)
        logits = self.lm_head(self.norm(h))
        shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
        shift_labels = labels[:, 1:].reshape(-1)
        loss = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
        return loss, logits


def main():
    config = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
    model = TinyOwl3(config)
    with torch.no_grad():
        # a visible gate so the images move the loss
        model.self_attn.gate_proj[0].bias.fill_(2.0)
    model.eval()
    template = mPlugOwl3Template()

    # Two samples of the same tokenized length: "<|im_start|>user <image>\n<image>\n q q<|im_end|> a a a"
    # (image tags already turned into [-100] by replace_tag), each with two images of its own.
    g = torch.Generator().manual_seed(1)
    examples = []
    for words in ([11, 12], [13, 14]):
        input_ids = [1, 2, -100, 3, -100, 3] + words + [4, 20, 21, 22, 5]
        labels = [-100] * 9 + [20, 21, 22, 5]
        images = [torch.randn(LENGTH_EACH_IMG, 12, generator=g) for _ in range(2)]
        examples.append({'input_ids': input_ids, 'labels': labels, 'images': images})

    batch = []
    for ex in examples:
        inputs = template._encode(ex)
        data = inputs.pop('_data')
        inputs.update(template._post_encode(model, data))
        batch.append(inputs)
    res = template.data_collator(batch)

    with torch.no_grad():
        loss, logits = model(res['input_ids'], res['attention_mask'], res['labels'],
                             image_embeds=res['image_embeds'], media_offset=res['media_offset'])
    print("media_offset[:, -1] per row:", res['media_offset'][:, -1].tolist())
    print("loss: %.6f" % loss.item())
    print("row 1 last logits[:4]:", [round(x, 4) for x in logits[1, -1, :4].tolist()])


if __name__ == "__main__":
    main()
