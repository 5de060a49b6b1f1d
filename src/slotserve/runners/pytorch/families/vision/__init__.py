"""The images of the vision-language families: what a family's record holds of them
(``base.py``), and each kind's image preparer and tower."""
