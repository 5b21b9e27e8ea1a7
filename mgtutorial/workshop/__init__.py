"""For instructors: the laptop check (``laptop_check``, ``laptop_packages``) and the student
edition of the notebooks (``edition``)."""
