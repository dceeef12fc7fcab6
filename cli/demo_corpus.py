"""The small English text the demo tokenizer is trained on (it is bundled, so the demo needs no download)."""

CORPUS = """\
Once upon a time, in a small town by the sea, there lived an old fisherman and his daughter.
Every morning they walked down to the harbour, pushed their boat into the water and sailed out past the lighthouse.
The weather was often cold and the waves were high, but the fish were plenty and the market paid well.
One day a storm came from the north. The sky turned dark, the wind howled, and the rain fell for three days.
When the storm had passed, the people of the town went down to the beach to see what the sea had brought them.
They found pieces of wood, a broken chair, a wooden box full of letters, and a little dog that was still alive.
The daughter took the dog home, dried it by the fire, and gave it some bread and warm milk.
From that day on the dog followed her everywhere: to school, to the market, and out on the boat.
Hello! How are you today? I am fine, thank you. What would you like to do this afternoon?
Let us go for a walk in the park, and then we can have a cup of tea and some cake at the new cafe.
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Please read the instructions carefully before you start, and ask a question if anything is not clear.
The meeting is scheduled for Tuesday at ten o'clock in the large conference room on the second floor.
Our team will review the report, summarize the main findings, and send the results to every department.
The customer asked for a refund because the package arrived late and the product was damaged.
Thank you for contacting support. We are sorry for the trouble and we will replace the item at no cost.
Your order number is 48213. It will be shipped within two business days and should arrive next week.
To reset your password, open the settings page, choose security, and follow the steps on the screen.
The contract between the two companies says that either party may end the agreement with thirty days notice.
The court found that the defendant had not broken the law, and the case was closed at the end of the year.
Every cover sheet must be attached to the report before it is filed, as the memo from management explains.
The printer on the third floor is out of paper again, and nobody seems to know who is supposed to fix it.
A language model reads a sequence of tokens and predicts the next one, one token at a time.
Low-rank adapters change a large model with a small number of new weights, so many of them can share one base model.
A server that hosts thousands of adapters must batch requests from different tenants on the same graphics card.
The scheduler decides which requests run in the next step, and the cache keeps the keys and values of every token.
When the queue is full, new requests are refused with a clear error so that the clients can retry later.
Mathematics is the study of numbers, shapes, and patterns. Two plus two is four, and ten times ten is one hundred.
Water boils at one hundred degrees and freezes at zero. The earth travels around the sun once every year.
Plants need light, water, and air to grow. Their leaves turn sunlight into the energy they need to live.
The history of the city goes back more than two thousand years, to a small village built on the river bank.
In the spring the gardens are full of flowers, and in the autumn the trees turn red, orange, and gold.
She opened the window, looked at the mountains in the distance, and decided that today was the day to climb them.
He wrote a long letter to his brother, describing the new house, the neighbours, and the strange noises at night.
The children laughed and played in the snow until their hands were cold and their mothers called them in for dinner.
Good morning, everyone. Today we will talk about the plan for the next quarter and the goals for each team.
First, we need to finish the project on time. Second, we must keep the costs low. Third, we learn from our mistakes.
If you have any questions, please send an email or call the office between nine in the morning and five in the evening.
The recipe is simple: mix the flour, the sugar, and the eggs, add a little butter, and bake for thirty minutes.
Music and art make life richer. Many people enjoy singing, painting, dancing, or playing an instrument after work.
The library is open every day except Sunday. Students can borrow up to ten books for three weeks at a time.
Travel by train is comfortable and fast. The journey from the capital to the coast takes less than four hours.
Doctors recommend that adults sleep seven to nine hours a night, drink enough water, and walk for half an hour each day.
The village council voted to build a new bridge over the river, which will open to traffic next summer.
A good story has a beginning, a middle, and an end. The hero wants something, faces a problem, and changes on the way.
"Where are you going?" asked the old man. "To the city," answered the boy, "to find work and to see the world."
Numbers such as 1, 2, 3, 10, 42, 100, 365 and 2024 appear in dates, prices, addresses, and phone numbers.
Computers store everything as bits. A program is a list of instructions that tells the computer what to do.
The weather forecast for tomorrow is sunny in the morning, with clouds and light rain in the afternoon.
Thank you very much for your help. I really appreciate it, and I hope we can work together again soon.
"""
