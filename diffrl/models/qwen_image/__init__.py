"""Qwen-Image (diffusers `QwenImagePipeline`) and its edit variant Qwen-Image-Edit (`QwenImageEditPipeline`): the
adapters (adapter.py, the "qwen_image" architecture; adapter_edit.py, "qwen_image_edit"), the tiny builders (tiny.py,
tiny_edit.py) and Qwen-Image's real-size configs (realsize.py, "qwen_image")."""
