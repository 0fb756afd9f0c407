from setuptools import setup

setup(cffi_modules=["csrc/build.py:ffibuilder"])
