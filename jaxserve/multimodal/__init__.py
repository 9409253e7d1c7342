"""Image input for vision-language models, the host side (no jax): which images a chat request
refers to and loading them under the server's media flags (media.py), and turning each image into
the arrays and prompt tokens a model expects, equal to transformers' PIL image processors
(image_processing.py), and what the engine takes of a prompt's images (inputs.py, mrope.py,
admission.py). Every refusal of an image is a `media.MediaError`, which the server answers with
HTTP 400. Nothing is imported here: the engine's side needs neither Pillow nor aiohttp."""
