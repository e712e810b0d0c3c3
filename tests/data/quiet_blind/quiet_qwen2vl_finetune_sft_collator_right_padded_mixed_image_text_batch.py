# Citation: 2U1/Qwen2-VL-Finetune @10901c7dbb1856485cae904c8b3381ead158d77e: src/dataset/sft_dataset.py
#   (SupervisedDataset.__getitem__, DataCollatorForSupervisedDataset), src/dataset/data_utils.py (replace_image_tokens,
#   llava_to_openai, pad_sequence), src/constants.py @33bb41679ac9a77f3f24e230527cb8c377ae5bfb; the model is
#   transformers' Qwen2VLForConditionalGeneration (tiny, from its config classes, random weights).
# Qwen2-VL supervised fine-tuning as that repo does it: LLaVA-style conversations are rewritten to ChatML with
# <|vision_start|><|image_pad|><|vision_end|>, a system turn is prepended with IGNORE_INDEX labels, each user turn
# goes through the processor (which expands <|image_pad|> to t*h*w/merge^2 tokens) and gets IGNORE_INDEX labels,
# each assistant answer is labelled with its own ids. The collator RIGHT-pads input_ids with the tokenizer's pad id
# (<|endoftext|>), labels with IGNORE_INDEX, sets attention_mask = input_ids != pad_token_id and concatenates the
# pixel_values / image_grid_thw of the rows that have images (here a text-only row sits between two image rows).
# The processor and tokenizer are small local stand-ins (no download): a fixed word vocabulary and Qwen2-VL's patch
# flattening. transformers 5 wants mm_token_type_ids beside input_ids (its processor returns them), so the stand-in
# returns them and the collator pads them with 0 (text) like input_ids.
# Self-check: each conversation run alone (no padding, all-ones mask, its own images): logits at every real position
# and the batch loss against the token-weighted sum of the per-conversation losses.
import copy
import re

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

torch.manual_seed(0)

# ---- src/constants.py ----
IGNORE_INDEX = -100

DEFAULT_IM_START_TOKEN = "<|im_start|>"
DEFAULT_IM_END_TOKEN = "<|im_end|>"
DEFAULT_IMAGE_TOKEN = "<|image_pad|>"
DEFAULT_VIDEO_TOKEN = "<|video_pad|>"
LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_VIDEO_TOKEN = "<video>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"

SYSTEM_MESSAGE = "You are a helpful assistant."


# ---- src/dataset/data_utils.py ----
def replace_image_tokens(input_string, is_video=False):
    if is_video:
        pattern = r'\n?' + re.escape(LLAVA_VIDEO_TOKEN) + r'\n?'
        replacement = VISION_START_TOKEN + DEFAULT_VIDEO_TOKEN + VISION_END_TOKEN
    else:
        pattern = r'\n?' + re.escape(LLAVA_IMAGE_TOKEN) + r'\n?'
        replacement = VISION_START_TOKEN + DEFAULT_IMAGE_TOKEN + VISION_END_TOKEN

    return re.sub(pattern, replacement, input_string)


def llava_to_openai(conversations, is_video=False):
    role_mapping = {"human": "user", "gpt": "assistant"}

    transformed_data = []
    for conversation in conversations:
        transformed_content = replace_image_tokens(conversation["value"], is_video=is_video)
        transformed_entry = {
            "role": role_mapping.get(conversation["from"], conversation["from"]),
            "content": transformed_content,
        }
        transformed_data.append(transformed_entry)

    return transformed_data


def pad_sequence(sequences, padding_side='right', padding_value=0):
    """
    Pad a list of sequences to the same length.
    sequences: list of tensors in [seq_len, *] shape
    """
    assert padding_side in ['right', 'left']
    max_size = sequences[0].size()
    trailing_dims = max_size[1:]
    max_len = max(len(seq) for seq in sequences)
    batch_size = len(sequences)
    output = sequences[0].new_full((batch_size, max_len) + trailing_dims, padding_value)
    for i, seq in enumerate(sequences):
        length = seq.size(0)
        if padding_side == 'right':
            output.data[i, :length] = seq
        else:
            output.data[i, -length:] = seq
    return output


# ---- local stand-ins for Qwen2VLProcessor / its tokenizer (no download) ----
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
VOCAB_SIZE = 160


class TinyTokenizer:
    def __init__(self):
        self.vocab = {}
        for i, s in enumerate(SPECIALS):
            self.vocab[s] = VOCAB_SIZE - len(SPECIALS) + i
        self.pad_token = "<|endoftext|>"
        self.pad_token_id = self.vocab[self.pad_token]
        self._split = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + r"|\n| ?[A-Za-z]+|[^A-Za-z\s]| )")

    def convert_tokens_to_ids(self, tok):
        return self.vocab[tok]

    def _id(self, piece):
        if piece not in self.vocab:
            self.vocab[piece] = len(self.vocab) - len(SPECIALS)
            assert self.vocab[piece] < VOCAB_SIZE - len(SPECIALS)
        return self.vocab[piece]

    def __call__(self, text, add_special_tokens=False, padding=False, return_tensors='pt'):
        if isinstance(text, str):
            text = [text]
        ids = [[self._id(p) for p in self._split.findall(t) if p] for t in text]
        return {"input_ids": torch.tensor(ids, dtype=torch.long)}


class TinyQwen2VLProcessor:
    def __init__(self, patch_size=2, temporal_patch_size=2, merge_size=2):
        self.tokenizer = TinyTokenizer()
        self.patch_size, self.temporal_patch_size, self.merge_size = patch_size, temporal_patch_size, merge_size
        self.image_token = DEFAULT_IMAGE_TOKEN

    def _image(self, image):  # Qwen2VLImageProcessor._preprocess on an already resized (C, H, W) image
        patches = image[None].repeat(self.temporal_patch_size, 1, 1, 1)
        channel = patches.shape[1]
        grid_t = patches.shape[0] // self.temporal_patch_size
        grid_h, grid_w = patches.shape[2] // self.patch_size, patches.shape[3] // self.patch_size
        m, p, tp = self.merge_size, self.patch_size, self.temporal_patch_size
        patches = patches.reshape(grid_t, tp, channel, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        flat = patches.reshape(grid_t * grid_h * grid_w, channel * tp * p * p)
        return flat, torch.tensor([grid_t, grid_h, grid_w])

    def __call__(self, text, images=None, videos=None, padding=False, do_resize=False, return_tensors='pt'):
        pv, thw = zip(*[self._image(im) for im in images])
        text = list(text)
        merge_length = self.merge_size ** 2
        index = 0
        for i in range(len(text)):
            while self.image_token in text[i]:
                num_image_tokens = int(thw[index].prod()) // merge_length
                text[i] = text[i].replace(self.image_token, "<|placeholder|>" * num_image_tokens, 1)
                index += 1
            text[i] = text[i].replace("<|placeholder|>", self.image_token)
        out = self.tokenizer(text, return_tensors='pt')
        out["mm_token_type_ids"] = (out["input_ids"] == self.tokenizer.convert_tokens_to_ids(self.image_token)).long()
        out["pixel_values"] = torch.cat(pv, 0)
        out["image_grid_thw"] = torch.stack(thw, 0)
        return out


# ---- src/dataset/sft_dataset.py ----
class SupervisedDataset(torch.utils.data.Dataset):
    """Dataset for supervised fine-tuning."""

    def __init__(self, data_path, processor, images, model_id="Qwen/Qwen2-VL-2B-Instruct"):
        super(SupervisedDataset, self).__init__()
        self.model_id = model_id
        self.processor = processor
        self.list_data_dict = data_path
        self.images = images  # stands in for get_image_info(image_file, ...)

    def __len__(self):
        return len(self.list_data_dict)

    def __getitem__(self, i):
        sources = self.list_data_dict[i]

        is_video = False

        processor = self.processor
        if "image" in sources:
            videos = None
            grid_key = "image_grid_thw"
            pixel_key = "pixel_values"

            image_files = sources["image"]
            if isinstance(image_files, str):
                image_files = [image_files]

            images = []
            for image_file in image_files:
                images.append(self.images[image_file])
        else:
            grid_key = None
            pixel_key = None
            images = None
            videos = None

        sources = copy.deepcopy(llava_to_openai(sources['conversations'], is_video=is_video))

        all_input_ids = []
        all_labels = []
        all_mm_token_type_ids = []
        all_pixel_values = []
        all_image_grid_thw = []

        # Qwen2-VL uses a default system message so I've added this.
        if len(SYSTEM_MESSAGE) > 0:
            system_message = f"{DEFAULT_IM_START_TOKEN}system\n{SYSTEM_MESSAGE}{DEFAULT_IM_END_TOKEN}\n"
            system_message_input_ids = processor.tokenizer(system_message, add_special_tokens=False, return_tensors='pt')['input_ids']
            system_labels = torch.full_like(system_message_input_ids, IGNORE_INDEX)

            all_input_ids.append(system_message_input_ids.squeeze(0))
            all_labels.append(system_labels.squeeze(0))
            all_mm_token_type_ids.append(torch.zeros_like(system_message_input_ids.squeeze(0)))

        for _, j in enumerate(range(0, len(sources), 2)):
            user_input = sources[j]
            gpt_response = sources[j + 1]

            user_input = f"{DEFAULT_IM_START_TOKEN}{user_input['role']}\n{user_input['content']}{DEFAULT_IM_END_TOKEN}\n{DEFAULT_IM_START_TOKEN}{gpt_response['role']}\n"
            gpt_response = f"{gpt_response['content']}{DEFAULT_IM_END_TOKEN}\n"

            if DEFAULT_IMAGE_TOKEN in user_input:
                inputs = processor(text=[user_input], images=images, videos=videos, padding=False, do_resize=False, return_tensors='pt')
                prompt_input_ids = inputs['input_ids']
                prompt_mm_token_type_ids = inputs['mm_token_type_ids']
                all_pixel_values.append(inputs[pixel_key])
                all_image_grid_thw.append(inputs[grid_key])
            else:
                prompt_input_ids = processor.tokenizer(user_input, add_special_tokens=False, padding=False, return_tensors='pt')['input_ids']
                prompt_mm_token_type_ids = torch.zeros_like(prompt_input_ids)

            response_input_ids = processor.tokenizer(gpt_response, add_special_tokens=False, padding=False, return_tensors='pt')['input_ids']

            input_ids = torch.cat([prompt_input_ids, response_input_ids], dim=1).squeeze(0)
            labels = torch.cat(
                [
                    torch.tensor([IGNORE_INDEX] * len(prompt_input_ids[0])),
                    response_input_ids.squeeze(0),
                ],
                dim=0,
            )

            all_input_ids.append(input_ids)
            all_labels.append(labels)
            all_mm_token_type_ids.append(torch.cat([prompt_mm_token_type_ids, torch.zeros_like(response_input_ids)], dim=1).squeeze(0))

        # There is no need for eos or bos tokens in the input_ids
        # Qwen2-VL does not use them
        input_ids = torch.cat(all_input_ids, dim=0).to(torch.long)
        labels = torch.cat(all_labels, dim=0).to(torch.long)
        mm_token_type_ids = torch.cat(all_mm_token_type_ids, dim=0).to(torch.long)

        attention_mask = (input_ids > -1000000).to(torch.long)

        data_dict = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            mm_token_type_ids=mm_token_type_ids,
        )

        if pixel_key and grid_key:
            pixel_values = torch.cat(all_pixel_values, dim=0)
            image_thw = torch.cat(all_image_grid_thw, dim=0)
            data_dict[pixel_key] = pixel_values
            data_dict[grid_key] = image_thw

        return data_dict


class DataCollatorForSupervisedDataset(object):
    """Collate examples for supervised fine-tuning."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples):
        batch_input_ids = []
        batch_label_ids = []
        batch_mm_token_type_ids = []
        batch_pixel_values = []
        batch_image_thw = []

        for example in examples:
            keys = example.keys()
            if "pixel_values" in keys:
                batch_pixel_values.append(example["pixel_values"])
                batch_image_thw.append(example["image_grid_thw"])

            batch_input_ids.append(example["input_ids"])
            batch_label_ids.append(example["labels"])
            batch_mm_token_type_ids.append(example["mm_token_type_ids"])

        input_ids = pad_sequence(
            batch_input_ids, padding_side='right', padding_value=self.pad_token_id
        )

        attention_mask = input_ids != self.pad_token_id
        labels = pad_sequence(batch_label_ids, padding_side='right', padding_value=IGNORE_INDEX)
        mm_token_type_ids = pad_sequence(batch_mm_token_type_ids, padding_side='right', padding_value=0)

        data_dict = {
            'input_ids': input_ids,
            'labels': labels,
            'attention_mask': attention_mask,
            'mm_token_type_ids': mm_token_type_ids,
        }

        if len(batch_pixel_values) > 0:
            pixel_values = torch.cat(batch_pixel_values, dim=0)
            image_thw = torch.cat(batch_image_thw, dim=0)
            data_dict["pixel_values"] = pixel_values
            data_dict["image_grid_thw"] = image_thw

        return data_dict


# ---- the run ----
processor = TinyQwen2VLProcessor()
tok = processor.tokenizer
config = Qwen2VLConfig(
    text_config=dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None,
                     rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}),
    vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                       temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
    image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"), video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
    vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
    vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"))
config._attn_implementation = "sdpa"
model = Qwen2VLForConditionalGeneration(config).eval()

images = {"cat.jpg": torch.randn(3, 8, 8),      # grid 1x4x4 -> 4 image tokens
          "chart.png": torch.randn(3, 8, 12)}   # grid 1x4x6 -> 6 image tokens
data = [
    {"image": "cat.jpg", "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"},
        {"from": "gpt", "value": "A cat on a mat."}]},
    {"conversations": [
        {"from": "human", "value": "Say hi."},
        {"from": "gpt", "value": "Hi."}]},
    {"image": "chart.png", "conversations": [
        {"from": "human", "value": "<image>\nDescribe the chart."},
        {"from": "gpt", "value": "Sales go up in the spring and fall in the winter months."},
        {"from": "human", "value": "Which month is best?"},
        {"from": "gpt", "value": "May."}]},
]
dataset = SupervisedDataset(data, processor, images)
collator = DataCollatorForSupervisedDataset(pad_token_id=tok.pad_token_id)
examples = [dataset[i] for i in range(len(dataset))]
batch = collator(examples)
print("input_ids", tuple(batch["input_ids"].shape), "real tokens per row", batch["attention_mask"].sum(-1).tolist())

with torch.no_grad():
    out = model(**batch)
    total_tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum()
    ref_sum = 0.0
    for i, ex in enumerate(examples):
        n = len(ex["input_ids"])
        single = {k: v[None] for k, v in ex.items() if k not in ("pixel_values", "image_grid_thw")}
        if "pixel_values" in ex:
            single["pixel_values"], single["image_grid_thw"] = ex["pixel_values"], ex["image_grid_thw"]
        ref = model(**single)
        torch.testing.assert_close(out.logits[i, :n], ref.logits[0], rtol=1e-4, atol=1e-5)
        ref_sum = ref_sum + ref.loss * (ex["labels"][1:] != IGNORE_INDEX).sum()
    torch.testing.assert_close(out.loss, ref_sum / total_tokens, rtol=1e-5, atol=1e-6)
print("batch loss", round(out.loss.item(), 5), "matches per-conversation runs")
