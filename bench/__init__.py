"""Side-by-side benchmark of radix-mlx against mlx-lm's own server (`python -m bench`)."""
