"""The texts every benchmark run speaks, and how many frames each one is run for.

Random weights never say anything meaningful and stop at random, so every run is made on a
checkpoint whose EOS row is zeroed and is cut at a frame count derived from its text: about what a
real voice would need (2.5 words per second of speech = 5 frames of 80 ms per word). The same
texts and frame counts go to our engine and to each baseline.
"""

from __future__ import annotations

FRAME_RATE_HZ = 12.5
SAMPLES_PER_FRAME = 1920
FRAMES_PER_WORD = 5
MIN_FRAMES = 12
MAX_FRAMES = 300

# 24 utterances of 3 to 60 words, as a voice agent would say them (TTFC percentiles).
UTTERANCES = (
    "Sure, one moment.",
    "Hello, how are you today?",
    "Your order has been confirmed.",
    "I can help you with that right away.",
    "Could you please repeat the last four digits of your card?",
    "Thanks for waiting. I found two flights that leave tomorrow morning.",
    "The pharmacy on Main Street closes at nine tonight, and it opens again at eight.",
    "Let me check the weather for you. It looks like rain in the afternoon, so take an umbrella.",
    "I have moved your appointment to Thursday at three thirty. You will get a text message to confirm it shortly.",
    ("Your balance is two hundred and fourteen dollars. The next payment is due on the fifth of next month, "
    "and autopay is turned on."),
    "Okay, sounds good.",
    "Got it, thank you very much.",
    ("Before we continue, I need to verify your identity. Could you tell me your date of birth and the postal "
    "code on your account?"),
    ("The restaurant has a table for four at seven fifteen on Saturday. Would you like me to book it, or should "
    "I look for something a little earlier in the evening?"),
    ("I am sorry to hear that your package arrived damaged. I have started a replacement, and a prepaid return "
    "label is on its way to your email address."),
    ("Here is a quick summary of your day. You have a team meeting at ten, lunch with Maria at noon, a dentist "
    "appointment at four, and your sister's birthday dinner at seven thirty tonight."),
    ("To reset your router, unplug it from the wall, wait for about thirty seconds, and plug it back in. The "
    "lights will blink for a minute or two. Once the internet light turns solid green, try connecting your "
    "laptop again and let me know what happens."),
    ("Great question. The museum is open every day except Monday, from ten in the morning until six in the "
    "evening. Tickets are twenty dollars for adults, twelve for students, and children under six get in for "
    "free. The modern art wing is closed this week for renovation, but everything else is open."),
    "No problem at all.",
    "Your train is running about ten minutes late.",
    ("I found three recipes that use chicken, rice and spinach. The quickest one takes twenty minutes and only "
    "needs one pan."),
    ("Thank you for calling. Our offices are closed for the holiday, but you can still pay your bill, check "
    "your usage, or report an outage online at any time."),
    ("Let me read that back to you: a large pepperoni pizza, a garden salad with ranch dressing on the side, "
    "and two cold bottles of sparkling water, delivered to apartment four B on the third floor. Is that all correct, or would you "
    "like to change anything before I place the order for you this evening, or add a dessert?"),
    "Yes, that works.",
)

# What a voice agent says in the fleet benchmark (`bench fleet`): replies of 5 to 15 words, so
# 25 to 75 frames (frames_for), of the kinds a support, booking or ordering agent gives.
FLEET_REPLIES = (
    "Okay, thank you very much.",
    "No problem, happy to help.",
    "Yes, that time works perfectly.",
    "Got it, let me check that.",
    "Sure, I can help you with that.",
    "Sorry about the wait, thank you for holding.",
    "Perfect, you're all set. Have a wonderful day!",
    "Great, I've updated your address on file.",
    "Sure thing, one moment while I look that up.",
    "Unfortunately that item is out of stock right now.",
    "Let me pull up your account, one moment please.",
    "Your appointment is confirmed for Tuesday at ten thirty.",
    "The total comes to forty two dollars and fifteen cents.",
    "Your package shipped this morning and should arrive on Friday.",
    "Is there anything else I can help you with today?",
    "Could you confirm the email address on your account, please?",
    "The password reset link has been sent to your phone.",
    "Just to confirm, you'd like the large size in blue?",
    "Okay, I've cancelled the order and you won't be charged.",
    "We have three options: standard, express, or next day delivery.",
    "Yes, we accept all major credit cards and digital wallets.",
    "I'm sorry, I didn't catch that. Could you say it again?",
    "Our store opens at nine and closes at six on weekdays.",
    "I can transfer you to a specialist, would that be okay?",
    "Your refund was processed and should appear within five business days.",
    "Your current plan includes unlimited calls and ten gigabytes of data.",
    "The doctor can see you on Monday morning at eight fifteen.",
    "That's a great choice, it's one of our most popular dishes.",
    "I'll send a confirmation to your email in just a moment.",
    "Your prescription will be ready for pickup after two this afternoon.",
    "Thanks for your patience, I'm still checking the availability for that date.",
    "Let me repeat that back to make sure I have it right.",
    "Traffic is light, so your driver should arrive in about six minutes.",
    "Alright, your reservation is moved to Saturday at seven in the evening.",
    "Would you prefer a call back in the morning or the afternoon?",
    "I see two open slots tomorrow, one at noon and one at three.",
    "I can put you on the waitlist and text you when it's back.",
    "Do you want me to book a table for two or four people?",
    "Your balance is due on the fifteenth, would you like to pay now?",
    "Got it, I've added a note for the technician about the side gate.",
    "Hmm, I'm not finding that order number. Could you check it once more?",
    "The warranty covers parts and labor for two years from the purchase date.",
    "That flight is full, but there's a seat on the next one at four.",
    "If you restart the app and sign in again, the new settings should appear.",
    "I understand how frustrating that must be, let me fix it for you right away.",
    "Before I book it, can I confirm the name and phone number for the reservation?",
)

# One long sentence for RTF and per-frame figures, run for a fixed 250 frames (20 s of audio) by
# every implementation, so the three are compared on exactly the same work.
RTF_TEXT = (
    "Thank you for calling the city library. Our main branch is open from nine in the morning until eight "
    "in the evening on weekdays, and from ten until five on Saturdays. You can renew books online or ask a "
    "librarian for help."
)
RTF_FRAMES = 250

# Streams in the concurrency test say this and are cut at this many frames (4 s of audio).
CONCURRENCY_TEXT = "Thanks for waiting. I found two flights that leave tomorrow morning."
CONCURRENCY_FRAMES = 50

# --quick (a smoke test of the harness): fewer utterances, shorter runs, one run of each.
QUICK_UTTERANCES = 4
QUICK_RTF_FRAMES = 24
RUNS = 3


def word_count(text: str) -> int:
    return len(text.split())


def frames_for(text: str) -> int:
    """Frames a real voice would need for this text (5 per word), clamped to [12, 300]."""
    return max(MIN_FRAMES, min(MAX_FRAMES, FRAMES_PER_WORD * word_count(text)))


def audio_seconds(frames: int) -> float:
    return frames / FRAME_RATE_HZ


def utterances_for(quick: bool) -> tuple[str, ...]:
    return UTTERANCES[:QUICK_UTTERANCES] if quick else UTTERANCES


def rtf_frames_for(quick: bool) -> int:
    return QUICK_RTF_FRAMES if quick else RTF_FRAMES


def runs_for(quick: bool) -> int:
    return 1 if quick else RUNS
