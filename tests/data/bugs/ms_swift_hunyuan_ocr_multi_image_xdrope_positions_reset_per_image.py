# ms-swift HunyuanOCR (HunYuanVL) SFT step on a two-image sample: the template's 4-axis XD-RoPE position_ids.
#
# Citation: modelscope/ms-swift commit 48fb0a9ee ("fix position_ids for multi images"), part of
# modelscope/ms-swift#7038 ("[model] support hunyuan_ocr"; the commit landed on the PR branch before the merge).
# swift/llm/template/template/tencent.py, HunYuanVLTemplate._encode, read at 48fb0a9ee^ (bug) and 48fb0a9ee (fix).
#
# Bug: the template builds HunYuanVL's position_ids as four rows (sequence, width, height, time) and writes each
# image's grid coordinates into the width/height/time rows. The four rows were created with torch.arange *inside*
# the per-image loop, so every image started from fresh 1-D rows and only the last image's grid survived:
# with two images, the first image's tokens kept text positions on the width/height/time axes.
# Fix: create the four rows once, before the loop, and stack them (and build the attention mask) after it.
#
# The model is transformers' HunYuanVLForConditionalGeneration (tiny config, random weights). The template hands
# position_ids as (batch, 4, seq); the installed transformers reads (4, batch, seq), so the collated tensor is
# transposed before the forward. Tokens are made-up ids (no tokenizer); the image processor is a stand-in that
# returns flat patches and image_grid_thw as HunYuanVL's image processor does.
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration

FIXED = "--fixed" in sys.argv

IMAGE_TOKEN_ID = 120120
PAD_ID = 120002
VOCAB = 120128


def findall(token_list: List[int], sub_token: int) -> List[int]:
    return [i for i, t in enumerate(token_list) if t == sub_token]


class _ImageProcessor:
    merge_size = 2
    patch_size = 4

    def __call__(self, images, return_tensors="pt"):
        pixel_values, grids = [], []
        for img in images:  # img: (3, H, W)
            _, H, W = img.shape
            gh, gw = H // self.patch_size, W // self.patch_size
            patches = img.reshape(3, gh, self.patch_size, gw, self.patch_size).permute(1, 3, 0, 2, 4)
            pixel_values.append(patches.reshape(gh * gw, -1))
            grids.append([1, gh, gw])
        return {"pixel_values": torch.cat(pixel_values), "image_grid_thw": torch.tensor(grids)}


class _Processor:
    image_processor = _ImageProcessor()
    pad_id = PAD_ID


class StdTemplateInputs:
    def __init__(self, input_ids, labels, images):
        self.input_ids, self.labels, self.images = input_ids, labels, images


class HunYuanVLTemplate:
    image_token_id = IMAGE_TOKEN_ID

    def __init__(self, processor):
        self.processor = processor

    def _encode_text(self, inputs: StdTemplateInputs) -> Dict[str, Any]:
        # Template._encode: the '<image>' tag has been replaced by [-100] (replace_tag returns [[-100]]).
        return {"input_ids": list(inputs.input_ids), "labels": list(inputs.labels), "loss_scale": None}

    @staticmethod
    def _extend_tokens(input_ids: List[int], labels: Optional[List[int]], loss_scale: Optional[List[float]],
                       replace_idx_list: List[int], get_new_tokens: Callable[[int], List[int]]
                       ) -> Tuple[List[int], Optional[List[int]], Optional[List[float]]]:
        added_tokens_len = 0
        for i, idx in enumerate(replace_idx_list):
            new_tokens = get_new_tokens(i)
            token_len = len(new_tokens)
            input_ids = input_ids[:idx + added_tokens_len] + new_tokens + input_ids[added_tokens_len + idx + 1:]
            if labels:
                labels = labels[:idx + added_tokens_len] + [-100] * token_len + labels[added_tokens_len + idx + 1:]
            added_tokens_len += token_len - 1
        return input_ids, labels, loss_scale

    def _encode(self, inputs: StdTemplateInputs) -> Dict[str, Any]:
        encoded = self._encode_text(inputs)
        input_ids = encoded['input_ids']
        labels = encoded['labels']
        loss_scale = encoded.get('loss_scale', None)
        idx_list = findall(input_ids, -100)
        processor = self.processor
        images = inputs.images
        if images:
            image_inputs = processor.image_processor(images=images, return_tensors='pt')
            image_grid_thw = image_inputs['image_grid_thw']
            merge_size = processor.image_processor.merge_size

            def _get_new_tokens(i):
                grid_h, grid_w = image_grid_thw[i][-2:]
                patch_h = grid_h // merge_size
                patch_w = grid_w // merge_size
                img_tokens: List[int] = [self.image_token_id] * (patch_h * (patch_w + 1) + 2)
                return img_tokens

            encoded['input_ids'], encoded['labels'], encoded['loss_scale'] = self._extend_tokens(
                input_ids, labels, loss_scale, idx_list, _get_new_tokens)
            encoded['pixel_values'] = image_inputs['pixel_values']
            encoded['image_grid_thw'] = image_grid_thw

            if FIXED:
                input_ids = encoded['input_ids']
                position_ids = torch.arange(len(input_ids))
                position_ids_w = torch.arange(len(input_ids))
                position_ids_h = torch.arange(len(input_ids))
                position_ids_t = torch.arange(len(input_ids))
            image_tokens_cumsum = [0]
            for i in range(len(image_grid_thw)):
                grid_h, grid_w = image_grid_thw[i][-2:]
                patch_h = grid_h // merge_size
                patch_w = grid_w // merge_size
                num_image_tokens = patch_h * (patch_w + 1) + 2
                image_tokens_cumsum.append(image_tokens_cumsum[-1] + int(num_image_tokens))

                if not FIXED:
                    input_ids = encoded['input_ids']
                    position_ids = torch.arange(len(input_ids))
                    position_ids_w = torch.arange(len(input_ids))
                    position_ids_h = torch.arange(len(input_ids))
                    position_ids_t = torch.arange(len(input_ids))
                image_token_pos_indices = torch.where(torch.tensor(input_ids) == self.image_token_id)
                start_pos = image_token_pos_indices[0][image_tokens_cumsum[i]] + 1
                replace_num = (patch_w + 1) * patch_h
                position_ids_w[start_pos:start_pos + replace_num] = torch.tensor(
                    list(range(patch_w + 1)) * patch_h, dtype=torch.int64)
                patch_h_list = []
                for h in range(patch_h):
                    patch_h_list += [h] * (patch_w + 1)
                position_ids_h[start_pos:start_pos + replace_num] = torch.tensor(patch_h_list, dtype=torch.int64)
                position_ids_t[start_pos:start_pos + replace_num] = 0

                if not FIXED:
                    position_ids = torch.stack([position_ids, position_ids_w, position_ids_h,
                                                position_ids_t]).unsqueeze(0)
                    encoded['position_ids'] = position_ids

                    attention_mask = torch.tensor(input_ids).ne(processor.pad_id)
                    encoded['attention_mask'] = attention_mask
            if FIXED:
                position_ids = torch.stack([position_ids, position_ids_w, position_ids_h, position_ids_t]).unsqueeze(0)
                encoded['position_ids'] = position_ids
                attention_mask = torch.tensor(input_ids).ne(processor.pad_id)
                encoded['attention_mask'] = attention_mask
        return encoded

    def data_collator(self, batch: List[Dict[str, Any]]) -> Dict[str, Any]:
        # one sample per batch here
        enc = batch[0]
        return {
            'input_ids': torch.tensor([enc['input_ids']]),
            'labels': torch.tensor([enc['labels']]),
            'attention_mask': enc['attention_mask'][None].long(),
            'position_ids': torch.cat([b['position_ids'] for b in batch], dim=0),
            'pixel_values': enc['pixel_values'],
            'image_grid_thw': enc['image_grid_thw'],
        }


def build_model():
    torch.manual_seed(0)
    config = HunYuanVLConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=PAD_ID,
            max_position_embeddings=512, initializer_range=0.2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 2, 2, 2]),
        ),
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            patch_size=4, spatial_merge_size=2, max_image_size=32, out_hidden_size=64, text_hidden_size=64,
        ),
        image_token_id=IMAGE_TOKEN_ID,
    )
    config._attn_implementation = "sdpa"
    model = HunYuanVLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "image_newline" in n or "image_begin" in n or "image_end" in n or "image_sep" in n:
                p.normal_(0.0, 1.0)
    return model


def main():
    model = build_model()
    template = HunYuanVLTemplate(_Processor())

    g = torch.Generator().manual_seed(1)
    img_a = torch.randn(3, 16, 16, generator=g)  # grid 4x4 -> 2x2 merged -> 2*(2+1)+2 = 8 tokens
    img_b = torch.randn(3, 16, 24, generator=g)  # grid 4x6 -> 2x3 merged -> 2*(3+1)+2 = 10 tokens

    # "<bos>Compare <image> with <image> and read both.<User>" + answer
    prompt = [1, 311, 412, -100, 513, -100, 614, 715, 816, 917, 120006]
    answer = [1018, 1119, 1220, 1321, 1422, 1523, 2]
    sample = StdTemplateInputs(prompt + answer, [-100] * len(prompt) + answer, [img_a, img_b])
    encoded = template._encode(sample)
    batch = template.data_collator([encoded])

    position_ids = batch['position_ids'].transpose(0, 1)  # (B, 4, L) -> (4, B, L) for the installed transformers
    with torch.no_grad():
        out = model(
            input_ids=batch['input_ids'],
            attention_mask=batch['attention_mask'],
            position_ids=position_ids,
            pixel_values=batch['pixel_values'],
            image_grid_thw=batch['image_grid_thw'],
            labels=batch['labels'],
        )
    ans_start = len(batch['input_ids'][0]) - len(answer)
    print("seq len", batch['input_ids'].shape[1], "| images", batch['image_grid_thw'].tolist())
    print("width row  :", batch['position_ids'][0, 1].tolist())
    print("height row :", batch['position_ids'][0, 2].tolist())
    print("sft loss   : %.6f" % out.loss.item())
    print("answer argmax:", out.logits[0, ans_start - 1:-1].argmax(-1).tolist())


if __name__ == "__main__":
    main()
