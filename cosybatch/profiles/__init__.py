"""Run profiles: YAML files (shipped ones beside this module) -> a frozen ``Profile`` ->
``RunSettings`` (see ``loader``, ``schema`` and ``resolve``)."""

from cosybatch.profiles.loader import (available_profiles, describe_profiles, load_profile, parse_override,
                                       profiles_dirs, resolve_profile_path)
from cosybatch.profiles.schema import (ARProfile, CodecProfile, HopsProfile, Optimizations, Profile, ProfileError,
                                       SamplingProfile, TextProfile)

__all__ = ["ARProfile", "CodecProfile", "HopsProfile", "Optimizations", "Profile", "ProfileError",
           "SamplingProfile", "TextProfile", "available_profiles", "describe_profiles", "load_profile", "parse_override",
           "profiles_dirs", "resolve_profile_path"]
