# ms-swift Qwen2-VL SFT step: the template's data_collator hands the model no position_ids.
#
# Citation: modelscope/ms-swift#2051 (commit b8a8ec5a4, "fix qwen2vl position_ids"; it points at
# huggingface/transformers#33487). swift/llm/utils/template.py, Qwen2VLTemplate._encode / data_collator and
# Template.data_collator (right padding), at the parent of b8a8ec5a4.
#
# Bug: at the time, Qwen2VLForConditionalGeneration computed its 3-D M-RoPE index (get_rope_index) only in
# prepare_inputs_for_generation. In a training forward (no generate) position_ids stayed None and the language
# model fell back to arange(seq_len) copied into all three rope sections: image tokens got 1-D text positions
# and the text after each image was numbered as if every image token were text.
# Fix: Qwen2VLTemplate.data_collator calls get_rope_index(input_ids, image_grid_thw, video_grid_thw,
# attention_mask) on the padded batch and returns res['position_ids'].
#
# The model is transformers' Qwen2-VL (tiny config, random weights); its forward is the Sept 2024 one
# (embed, splice the visual tower's output at the image tokens, language model with the given position_ids).
# get_rope_index is ported from transformers v4.45.0.
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

FIXED = "--fixed" in sys.argv

PAD_ID = 0
VISION_START = 5
IMAGE_PAD = 6
VIDEO_PAD = 7
VISION_END = 8


def _findall(token_list: List[int], sub_token: int) -> List[int]:
    return [i for i, t in enumerate(token_list) if t == sub_token]


class _ImageProcessor:
    merge_size = 2
    patch_size = 2
    temporal_patch_size = 2

    def __call__(self, images, videos=None, return_tensors='pt'):
        # images here are (h, w) sizes; pixel rows are random patches of the right count
        pixel_values, grid_thw = [], []
        for (h, w) in images:
            gh, gw = h // self.patch_size, w // self.patch_size
            pixel_values.append(torch.randn(gh * gw, 3 * self.temporal_patch_size * self.patch_size ** 2))
            grid_thw.append([1, gh, gw])
        return {'pixel_values': torch.cat(pixel_values), 'image_grid_thw': torch.tensor(grid_thw)}


class _Processor:
    image_processor = _ImageProcessor()


class _Tokenizer:
    pad_token_id = PAD_ID
    processor = _Processor()


class Qwen2VLTemplate:
    padding_side = 'right'

    def __init__(self, tokenizer, model):
        self.tokenizer = tokenizer
        self.model = model

    def _encode(self, example: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        # super()._encode(example) has produced input_ids / labels with one <|image_pad|> per image
        inputs = {'input_ids': list(example['input_ids']), 'labels': list(example['labels'])}
        processor = self.tokenizer.processor
        input_ids = inputs['input_ids']
        labels = inputs['labels']
        images = example.get('images') or []
        if images:
            media_token = IMAGE_PAD
            media_inputs = processor.image_processor(images=images, videos=None, return_tensors='pt')
            media_grid_thw = media_inputs['image_grid_thw']
            idx_list = _findall(input_ids, media_token)
            added_tokens_len = 0
            for i, idx in enumerate(idx_list):
                merge_length = processor.image_processor.merge_size**2
                token_len = int(media_grid_thw[i].prod() // merge_length)
                input_ids = input_ids[:idx + added_tokens_len] + [media_token] * token_len + input_ids[added_tokens_len
                                                                                                      + idx + 1:]
                if labels:
                    labels = labels[:idx + added_tokens_len] + [-100] * token_len + labels[added_tokens_len + idx + 1:]
                added_tokens_len += token_len - 1
            inputs.update(media_inputs)
        inputs['input_ids'] = input_ids
        inputs['labels'] = labels
        return inputs, {}

    @staticmethod
    def pad_sequence(sequences: List[torch.Tensor], padding_value: float = 0., padding_side: str = 'right'):
        padding_right = padding_side == 'right'
        if padding_right:
            return torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True, padding_value=padding_value)
        max_len = max(s.size(0) for s in sequences)
        padded = []
        for s in sequences:
            padded.append(F.pad(s, (max_len - s.size(0), 0), 'constant', padding_value))
        return torch.stack(padded)

    def _base_data_collator(self, batch: List[Dict[str, Any]], padding_to: Optional[int] = None) -> Dict[str, Any]:
        tokenizer = self.tokenizer
        res = {}
        input_ids = [torch.tensor(b['input_ids']) for b in batch]
        res['input_ids'] = input_ids
        res['attention_mask'] = [torch.ones(len(input_ids[i]), dtype=torch.int64) for i in range(len(input_ids))]
        for key in ['labels', 'loss_scale', 'position_ids']:
            if key in batch[0]:
                res[key] = [torch.tensor(b[key]) for b in batch]
        for key, value in zip(['input_ids', 'inputs_embeds', 'attention_mask', 'labels', 'loss_scale', 'position_ids'],
                              [tokenizer.pad_token_id, 0., 0, -100, 0., -1]):
            if key in res:
                res[key] = self.pad_sequence(res[key], value, self.padding_side)
        pixel_values = [b['pixel_values'] for b in batch if b.get('pixel_values') is not None]
        if pixel_values:
            res['pixel_values'] = torch.concat(pixel_values)
        return res

    def data_collator(self, batch: List[Dict[str, Any]], padding_to: Optional[int] = None) -> Dict[str, Any]:
        res = self._base_data_collator(batch, padding_to)
        for media_type in ['image', 'video']:
            grid_thw = [b[f'{media_type}_grid_thw'] for b in batch if b.get(f'{media_type}_grid_thw') is not None]
            if grid_thw:
                res[f'{media_type}_grid_thw'] = torch.concat(grid_thw)
        if FIXED and 'input_ids' in res:
            # fix https://github.com/huggingface/transformers/pull/33487
            position_ids, _ = self.model.get_rope_index(res['input_ids'], res.get('image_grid_thw'),
                                                        res.get('video_grid_thw'), res['attention_mask'])
            res['position_ids'] = position_ids.contiguous()
        return res


class Qwen2VLForConditionalGenerationSept2024(Qwen2VLForConditionalGeneration):

    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        spatial_merge_size = self.config.vision_config.spatial_merge_size
        image_token_id = self.config.image_token_id
        video_token_id = self.config.video_token_id
        vision_start_token_id = self.config.vision_start_token_id
        mrope_position_deltas = []
        if image_grid_thw is not None or video_grid_thw is not None:
            total_input_ids = input_ids
            position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype,
                                      device=input_ids.device)
            image_index, video_index = 0, 0
            for i, input_ids in enumerate(total_input_ids):
                if attention_mask is not None:
                    input_ids = input_ids[attention_mask[i] == 1]
                vision_start_indices = torch.argwhere(input_ids == vision_start_token_id).squeeze(1)
                vision_tokens = input_ids[vision_start_indices + 1]
                image_nums = (vision_tokens == image_token_id).sum()
                video_nums = (vision_tokens == video_token_id).sum()
                input_tokens = input_ids.tolist()
                llm_pos_ids_list: list = []
                st = 0
                remain_images, remain_videos = image_nums, video_nums
                for _ in range(image_nums + video_nums):
                    if image_token_id in input_tokens and remain_images > 0:
                        ed_image = input_tokens.index(image_token_id, st)
                    else:
                        ed_image = len(input_tokens) + 1
                    if video_token_id in input_tokens and remain_videos > 0:
                        ed_video = input_tokens.index(video_token_id, st)
                    else:
                        ed_video = len(input_tokens) + 1
                    if ed_image < ed_video:
                        t, h, w = (image_grid_thw[image_index][0], image_grid_thw[image_index][1],
                                   image_grid_thw[image_index][2])
                        image_index += 1
                        remain_images -= 1
                        ed = ed_image
                    else:
                        t, h, w = (video_grid_thw[video_index][0], video_grid_thw[video_index][1],
                                   video_grid_thw[video_index][2])
                        video_index += 1
                        remain_videos -= 1
                        ed = ed_video
                    llm_grid_t, llm_grid_h, llm_grid_w = (t.item(), h.item() // spatial_merge_size,
                                                          w.item() // spatial_merge_size)
                    text_len = ed - st
                    st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                    llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                    t_index = torch.arange(llm_grid_t).view(-1, 1).expand(-1, llm_grid_h * llm_grid_w).flatten()
                    h_index = torch.arange(llm_grid_h).view(1, -1, 1).expand(llm_grid_t, -1, llm_grid_w).flatten()
                    w_index = torch.arange(llm_grid_w).view(1, 1, -1).expand(llm_grid_t, llm_grid_h, -1).flatten()
                    llm_pos_ids_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
                    st = ed + llm_grid_t * llm_grid_h * llm_grid_w
                if st < len(input_tokens):
                    st_idx = llm_pos_ids_list[-1].max() + 1 if len(llm_pos_ids_list) > 0 else 0
                    text_len = len(input_tokens) - st
                    llm_pos_ids_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
                llm_positions = torch.cat(llm_pos_ids_list, dim=1).reshape(3, -1)
                position_ids[..., i, attention_mask[i] == 1] = llm_positions.to(position_ids.device)
                mrope_position_deltas.append(llm_positions.max() + 1 - len(total_input_ids[i]))
            mrope_position_deltas = torch.tensor(mrope_position_deltas, device=input_ids.device).unsqueeze(1)
            return position_ids, mrope_position_deltas
        else:
            if attention_mask is not None:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids.masked_fill_(attention_mask == 0, 1)
                position_ids = position_ids.unsqueeze(0).expand(3, -1, -1).to(input_ids.device)
                max_position_ids = position_ids.max(0, keepdim=False)[0].max(-1, keepdim=True)[0]
                mrope_position_deltas = max_position_ids + 1 - attention_mask.shape[-1]
            else:
                position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device).view(1, 1, -1).expand(
                    3, input_ids.shape[0], -1))
                mrope_position_deltas = torch.zeros([input_ids.shape[0], 1], device=input_ids.device,
                                                    dtype=input_ids.dtype)
            return position_ids, mrope_position_deltas

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, pixel_values=None,
                image_grid_thw=None, **kwargs):
        inputs_embeds = self.model.language_model.embed_tokens(input_ids)
        if pixel_values is not None:
            pixel_values = pixel_values.type(self.model.visual.dtype)
            image_embeds = torch.cat(self.model.get_image_features(pixel_values, image_grid_thw).pooler_output)
            image_mask = input_ids == self.config.image_token_id
            inputs_embeds = inputs_embeds.clone()
            inputs_embeds[image_mask] = image_embeds.to(inputs_embeds.dtype)
        outputs = self.model.language_model(
            input_ids=None,
            position_ids=position_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            use_cache=False,
        )
        hidden_states = outputs[0]
        logits = self.lm_head(hidden_states).float()
        loss = None
        if labels is not None:
            shift_logits = logits[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, self.config.text_config.vocab_size), shift_labels.view(-1))
        return loss, logits


def main():
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0,
                                          'mrope_section': [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, in_channels=3, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )
    config._attn_implementation = 'sdpa'
    config.text_config._attn_implementation = 'sdpa'
    config.vision_config._attn_implementation = 'sdpa'
    model = Qwen2VLForConditionalGenerationSept2024(config).eval()

    template = Qwen2VLTemplate(_Tokenizer(), model)
    # two SFT examples: "<|im_start|>user <vision_start><image_pad><vision_end> question <|im_end|> answer"
    examples = [
        {'input_ids': [1, 20, VISION_START, IMAGE_PAD, VISION_END, 21, 22, 2, 30, 31, 32, 33, 2],
         'labels': [-100] * 8 + [30, 31, 32, 33, 2],
         'images': [(8, 8)]},
        {'input_ids': [1, 20, 23, 24, VISION_START, IMAGE_PAD, VISION_END, 25, 2, 40, 41, 2],
         'labels': [-100] * 9 + [40, 41, 2],
         'images': [(8, 12)]},
    ]
    batch = [template._encode(e)[0] for e in examples]
    res = template.data_collator(batch)

    with torch.no_grad():
        loss, logits = model(**res)
    print('input_ids shape', tuple(res['input_ids'].shape), 'position_ids given:', 'position_ids' in res)
    print('loss %.6f' % loss.item())
    last = (res['attention_mask'].sum(-1) - 1)
    print('last-token argmax per row', [int(logits[i, last[i]].argmax()) for i in range(logits.shape[0])])


if __name__ == '__main__':
    main()
