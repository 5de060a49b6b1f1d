"""The decoder every family shares, and its layers: shapes in, no family named."""
