# Correct program (quiet batch quiet-r86b).
#
# Citation: salesforce/ALBEF models/model_retrieval.py @69e9225506c76a4057c5099d0a7976b4f5e4d43c (ALBEF.forward:
# image_atts = ones, text encoder in mode='text', ITM fusion in mode='fusion' with the positive pair and with hard
# negatives whose text_atts_neg travel with their embeddings), models/xbert.py @91de3c19c370f31283bac2699bf4416c918159d3
# (BertModel.get_extended_attention_mask / invert_attention_mask, BertEncoder.forward's text / fusion split at
# fusion_layer, BertSelfAttention with is_cross_attention), Retrieval.py evaluation (k-candidate ITM rerank:
# image features repeated k times against the candidates' text ids and masks).
#
# The text tower is a BERT whose first `fusion_layer` layers are text-only; the remaining layers add
# cross-attention to the ViT's patch embeddings. Captions are right padded by the BERT tokenizer
# (padding='longest'); the text self-attention masks padded keys with (1 - mask) * -10000, the image side is
# never padded (image_atts all ones). Everything below must equal each caption run alone, unpadded, unmasked.
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class BertConfig:
    vocab_size = 50
    hidden_size = 32
    num_hidden_layers = 4
    fusion_layer = 2
    num_attention_heads = 4
    intermediate_size = 64
    max_position_embeddings = 32
    layer_norm_eps = 1e-12
    encoder_width = 48
    pad_token_id = 0


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, :seq_length]
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config, is_cross_attention):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        kv_width = config.encoder_width if is_cross_attention else config.hidden_size
        self.key = nn.Linear(kv_width, self.all_head_size)
        self.value = nn.Linear(kv_width, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        mixed_query_layer = self.query(hidden_states)
        is_cross_attention = encoder_hidden_states is not None
        if is_cross_attention:
            key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
            value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
            attention_mask = encoder_attention_mask
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
        query_layer = self.transpose_for_scores(mixed_query_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class BertAttention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.self = BertSelfAttention(config, is_cross_attention)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        out = self.self(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask)
        return self.LayerNorm(self.dense(out) + hidden_states)


class BertLayer(nn.Module):
    def __init__(self, config, layer_num):
        super().__init__()
        self.attention = BertAttention(config)
        self.has_cross_attention = layer_num >= config.fusion_layer
        if self.has_cross_attention:
            self.crossattention = BertAttention(config, is_cross_attention=True)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        attention_output = self.attention(hidden_states, attention_mask)
        if self.has_cross_attention:
            assert encoder_hidden_states is not None, "encoder_hidden_states must be given for cross-attention layers"
            attention_output = self.crossattention(
                attention_output, attention_mask, encoder_hidden_states, encoder_attention_mask
            )
        layer_output = self.output(F.gelu(self.intermediate(attention_output)))
        return self.LayerNorm(layer_output + attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([BertLayer(config, i) for i in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                mode="multi_modal"):
        if mode == "text":
            start_layer, output_layer = 0, self.config.fusion_layer
        elif mode == "fusion":
            start_layer, output_layer = self.config.fusion_layer, self.config.num_hidden_layers
        else:
            start_layer, output_layer = 0, self.config.num_hidden_layers
        for i in range(start_layer, output_layer):
            hidden_states = self.layer[i](hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask)
        return hidden_states


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def get_extended_attention_mask(self, attention_mask, input_shape):
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(f"Wrong shape for input_ids (shape {input_shape}) or attention_mask")
        extended_attention_mask = extended_attention_mask.to(dtype=torch.float32)
        return (1.0 - extended_attention_mask) * -10000.0

    def invert_attention_mask(self, encoder_attention_mask):
        encoder_extended_attention_mask = encoder_attention_mask[:, None, None, :].to(dtype=torch.float32)
        return (1.0 - encoder_extended_attention_mask) * -10000.0

    def forward(self, input_ids=None, attention_mask=None, encoder_embeds=None, encoder_hidden_states=None,
                encoder_attention_mask=None, mode="multi_modal"):
        if input_ids is not None:
            input_shape = input_ids.size()
        else:
            input_shape = encoder_embeds.size()[:-1]
        if attention_mask is None:
            attention_mask = torch.ones(input_shape, dtype=torch.long)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, input_shape)
        if encoder_hidden_states is not None:
            if encoder_attention_mask is None:
                encoder_attention_mask = torch.ones(encoder_hidden_states.size()[:-1], dtype=torch.long)
            encoder_extended_attention_mask = self.invert_attention_mask(encoder_attention_mask)
        else:
            encoder_extended_attention_mask = None
        embedding_output = self.embeddings(input_ids) if encoder_embeds is None else encoder_embeds
        return self.encoder(embedding_output, extended_attention_mask, encoder_hidden_states,
                            encoder_extended_attention_mask, mode=mode)


class VisionTransformer(nn.Module):
    """A two-block ViT (cls token + 16 patches); no mask, every image has the same number of patches."""

    def __init__(self, img_size=16, patch_size=4, embed_dim=48, depth=2, num_heads=4):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)
        num_patches = (img_size // patch_size) ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, num_patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList(
            [nn.TransformerEncoderLayer(embed_dim, num_heads, 96, dropout=0.0, batch_first=True, norm_first=True)
             for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class ALBEF(nn.Module):
    def __init__(self, config, embed_dim=16):
        super().__init__()
        self.visual_encoder = VisionTransformer(embed_dim=config.encoder_width)
        self.text_encoder = BertModel(config)
        self.vision_proj = nn.Linear(config.encoder_width, embed_dim)
        self.text_proj = nn.Linear(config.hidden_size, embed_dim)
        self.itm_head = nn.Linear(config.hidden_size, 2)
        self.temp = nn.Parameter(torch.ones([]) * 0.07)

    def forward(self, image, text_input_ids, text_attention_mask, neg_image_idx, neg_text_idx):
        image_embeds = self.visual_encoder(image)
        image_atts = torch.ones(image_embeds.size()[:-1], dtype=torch.long)
        image_feat = F.normalize(self.vision_proj(image_embeds[:, 0, :]), dim=-1)
        text_embeds = self.text_encoder(text_input_ids, attention_mask=text_attention_mask, mode="text")
        text_feat = F.normalize(self.text_proj(text_embeds[:, 0, :]), dim=-1)

        sim_i2t = image_feat @ text_feat.t() / self.temp
        sim_t2i = text_feat @ image_feat.t() / self.temp
        sim_targets = torch.eye(image.size(0))
        loss_i2t = -torch.sum(F.log_softmax(sim_i2t, dim=1) * sim_targets, dim=1).mean()
        loss_t2i = -torch.sum(F.log_softmax(sim_t2i, dim=1) * sim_targets, dim=1).mean()
        loss_ita = (loss_i2t + loss_t2i) / 2

        output_pos = self.text_encoder(encoder_embeds=text_embeds, attention_mask=text_attention_mask,
                                       encoder_hidden_states=image_embeds, encoder_attention_mask=image_atts,
                                       mode="fusion")
        bs = image.size(0)
        # hard negatives (drawn from the similarity weights upstream; fixed indices here)
        image_embeds_neg = torch.stack([image_embeds[neg_image_idx[b]] for b in range(bs)], dim=0)
        text_embeds_neg = torch.stack([text_embeds[neg_text_idx[b]] for b in range(bs)], dim=0)
        text_atts_neg = torch.stack([text_attention_mask[neg_text_idx[b]] for b in range(bs)], dim=0)

        text_embeds_all = torch.cat([text_embeds, text_embeds_neg], dim=0)
        text_atts_all = torch.cat([text_attention_mask, text_atts_neg], dim=0)
        image_embeds_all = torch.cat([image_embeds_neg, image_embeds], dim=0)
        image_atts_all = torch.cat([image_atts, image_atts], dim=0)
        output_neg = self.text_encoder(encoder_embeds=text_embeds_all, attention_mask=text_atts_all,
                                       encoder_hidden_states=image_embeds_all, encoder_attention_mask=image_atts_all,
                                       mode="fusion")
        vl_embeddings = torch.cat([output_pos[:, 0, :], output_neg[:, 0, :]], dim=0)
        vl_output = self.itm_head(vl_embeddings)
        itm_labels = torch.cat([torch.ones(bs, dtype=torch.long), torch.zeros(2 * bs, dtype=torch.long)], dim=0)
        loss_itm = F.cross_entropy(vl_output, itm_labels)
        return loss_ita, loss_itm, vl_output, text_feat, image_feat


def collate(captions, pad_token_id):
    """BertTokenizer(padding='longest'): right padding, attention_mask 1 on tokens."""
    longest = max(len(c) for c in captions)
    input_ids = torch.full((len(captions), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(captions), longest), dtype=torch.long)
    for i, c in enumerate(captions):
        input_ids[i, : len(c)] = torch.tensor(c)
        attention_mask[i, : len(c)] = 1
    return input_ids, attention_mask


def itm_alone(model, image_embeds_one, caption):
    """Reference: one caption alone (no padding, no mask) fused with one image."""
    ids = torch.tensor([caption])
    text_embeds = model.text_encoder(ids, mode="text")
    fused = model.text_encoder(encoder_embeds=text_embeds, encoder_hidden_states=image_embeds_one, mode="fusion")
    return model.itm_head(fused[:, 0, :])[0], F.normalize(model.text_proj(text_embeds[:, 0, :]), dim=-1)[0]


def main():
    config = BertConfig()
    model = ALBEF(config).eval()
    g = torch.Generator().manual_seed(3)
    CLS, SEP = 1, 2
    captions = [[CLS] + torch.randint(3, 50, (n,), generator=g).tolist() + [SEP] for n in (7, 2, 11, 4)]
    images = torch.randn(4, 3, 16, 16, generator=g)
    input_ids, attention_mask = collate(captions, config.pad_token_id)
    neg_image_idx, neg_text_idx = [1, 2, 3, 0], [2, 3, 0, 1]

    with torch.no_grad():
        loss_ita, loss_itm, vl_output, text_feat, image_feat = model(
            images, input_ids, attention_mask, neg_image_idx, neg_text_idx)

        image_embeds = model.visual_encoder(images)
        bs = len(captions)
        ref_text_feat = []
        ref_logits = [None] * (3 * bs)
        for b in range(bs):
            logit, tf = itm_alone(model, image_embeds[b : b + 1], captions[b])
            ref_logits[b] = logit
            ref_text_feat.append(tf)
            # negatives: caption b with image neg_image_idx[b]; image b with caption neg_text_idx[b]
            ref_logits[bs + b] = itm_alone(model, image_embeds[neg_image_idx[b] : neg_image_idx[b] + 1], captions[b])[0]
            ref_logits[2 * bs + b] = itm_alone(model, image_embeds[b : b + 1], captions[neg_text_idx[b]])[0]
        ref_logits = torch.stack(ref_logits)
        ref_text_feat = torch.stack(ref_text_feat)
        assert torch.allclose(text_feat, ref_text_feat, atol=1e-5)
        assert torch.allclose(vl_output, ref_logits, atol=1e-5), (vl_output - ref_logits).abs().max()

        # Double-loop ITA / ITM losses from the per-caption reference features and logits.
        sim = image_feat @ ref_text_feat.t() / model.temp
        ita = 0.0
        for b in range(bs):
            ita = ita - F.log_softmax(sim[b], 0)[b] / (2 * bs) - F.log_softmax(sim[:, b], 0)[b] / (2 * bs)
        assert torch.allclose(loss_ita, ita, atol=1e-5), (loss_ita, ita)
        itm = 0.0
        for r in range(3 * bs):
            itm = itm - F.log_softmax(ref_logits[r], 0)[1 if r < bs else 0] / (3 * bs)
        assert torch.allclose(loss_itm, itm, atol=1e-5), (loss_itm, itm)

        # Retrieval.py evaluation, i2t: for each image the top-k captions by ITA similarity are reranked by ITM,
        # the image's embeddings repeated k times against the candidates' padded ids and attention masks.
        k = 3
        text_embeds_all = model.text_encoder(input_ids, attention_mask=attention_mask, mode="text")
        sims_matrix = image_feat @ text_feat.t()
        for i in range(bs):
            topk_sim, topk_idx = sims_matrix[i].topk(k=k, dim=0)
            encoder_output = image_embeds[i].repeat(k, 1, 1)
            encoder_att = torch.ones(encoder_output.size()[:-1], dtype=torch.long)
            output = model.text_encoder(encoder_embeds=text_embeds_all[topk_idx],
                                        attention_mask=attention_mask[topk_idx],
                                        encoder_hidden_states=encoder_output, encoder_attention_mask=encoder_att,
                                        mode="fusion")
            score = model.itm_head(output[:, 0, :])[:, 1]
            for j, t in enumerate(topk_idx.tolist()):
                ref = itm_alone(model, image_embeds[i : i + 1], captions[t])[0][1]
                assert torch.allclose(score[j], ref, atol=1e-5), (i, t, score[j], ref)

    print("ALBEF retrieval: ITA features, ITM logits with hard negatives, losses and k-rerank scores match per-caption runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
