"""flexium"""
