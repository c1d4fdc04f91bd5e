"""The protocol: admissions (frozen inputs), run records, the resource screen and its gates."""
